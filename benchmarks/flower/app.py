"""A workload of :mod:`workloads` as a Flower 1.42 simulation (legacy Strategy API, ``run_simulation``).

usage: app.py WORKLOAD N K ROUNDS [--data NPZ] [--cpus 1]     (run with Flower's environment's python)

A ``NumPyClient`` per client (its fit is the workload's), ``FedAvg`` sampling of fixed-size cohorts
of K of N with the workload's ProjAvg as ``aggregate_fit``, no evaluation, Ray backend with
``client_resources = {"num_cpus": 1}`` (one actor per core). Prints one line
``RESULT {json}`` with the end of every round in seconds since this process started.
"""

import time

T0 = time.perf_counter()                  # process start (before the flwr and ray imports)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # else numpy's small eigh leaves a core spinning
warnings.filterwarnings("ignore")

from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server import ServerApp, ServerAppComponents, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

import workloads  # noqa: E402


class FitClient(NumPyClient):
    """One client: its fit is the workload's (data read or regenerated from its id inside fit)."""

    def __init__(self, workload: str, cid: int, data: str):
        self.workload, self.cid, self.data = workload, cid, data

    def fit(self, parameters, config):
        rnd = int(config["round"])
        if self.workload == "fedpca":
            return workloads.fedpca_fit(parameters, self.cid, rnd), workloads.FEDPCA["records"], {}
        model, records = workloads.spdnet_fit(parameters, self.cid, rnd, self.data)
        return model, records, {}


class ProjAvg(FedAvg):
    """FedAvg's fixed-size cohorts; aggregation = the workload's ProjAvg; round ends recorded."""

    round_ends: list = []
    average = staticmethod(workloads.fedpca_average)

    def aggregate_fit(self, server_round, results, failures):
        if failures:
            raise RuntimeError(f"round {server_round}: {len(failures)} failures: {failures[:1]}")
        models = [parameters_to_ndarrays(res.parameters) for _, res in results]
        self.round_ends.append(time.perf_counter() - T0)
        return ndarrays_to_parameters(self.average(models)), {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=["fedpca", "spdnet"])
    ap.add_argument("n", type=int)
    ap.add_argument("k", type=int)
    ap.add_argument("rounds", type=int)
    ap.add_argument("--data", default="", help="spdnet: the .npz of every client's covariances")
    ap.add_argument("--cpus", type=float, default=1.0, help="num_cpus of each client actor")
    ap.add_argument("--ray-tmp", default=None, help="Ray's session directory")
    a = ap.parse_args()

    init = workloads.fedpca_init() if a.workload == "fedpca" else workloads.spdnet_init()
    ProjAvg.average = staticmethod(workloads.fedpca_average if a.workload == "fedpca" else workloads.spdnet_average)
    strategy = ProjAvg(
        fraction_fit=a.k / a.n, min_fit_clients=a.k, min_available_clients=a.n,
        fraction_evaluate=0.0, min_evaluate_clients=0,
        on_fit_config_fn=lambda r: {"round": r},
        initial_parameters=ndarrays_to_parameters(init),
    )
    server_app = ServerApp(server_fn=lambda ctx: ServerAppComponents(
        strategy=strategy, config=ServerConfig(num_rounds=a.rounds)))

    def client_fn(context: Context):
        return FitClient(a.workload, int(context.node_config["partition-id"]), a.data).to_client()

    init_args = {"_temp_dir": a.ray_tmp} if a.ray_tmp else {}
    run_simulation(
        server_app=server_app, num_supernodes=a.n, client_app=ClientApp(client_fn=client_fn),
        backend_config={"client_resources": {"num_cpus": a.cpus, "num_gpus": 0.0}, "init_args": init_args},
    )
    ends = ProjAvg.round_ends
    if len(ends) != a.rounds:
        raise SystemExit(f"only {len(ends)} of {a.rounds} rounds finished")
    print("RESULT " + json.dumps({"engine": "flower", "round_ends": ends,
                                  "rounds": [b - e for e, b in zip(ends, ends[1:])]}), flush=True)


if __name__ == "__main__":
    main()
