"""Clients of one executor trained together against the same clients trained one by one.

A client actor hosting 10 clients of a round runs their local training in one process. Vectorised
(:func:`rfedray.federated.client.train_together`, the executor's default): each local step is one
set of kernels for the 10 clients. One by one (``LocalExecutor(vectorise=False)``):
:meth:`~rfedray.federated.client.Client.local_train` (the kernel's one-client case) client after client. The two executors train
the same cohort from the same theta_t with the same seeded randomness (the results are equal, see
``tests/test_batched_clients.py``), alternating round by round in this process; the time of a
round's training is the process's CPU time (the work, not the waits for a core on shared machines).

Settings: the Ray benchmark's clients (federated PCA on Gr(40, 4), 1,000 records, tau = 5,
B = 50), and the paper's Table 4 clients (5,000 records, tau = 10, B = 500).

Run: ``python benchmarks/bench_batched.py [--rounds 10] [--clients 10] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from bench_eeg_step import CLOCKS, synchronize
from rfedray.config import load_config
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import initial_params, local_plan

SETTINGS = {
    "Ray benchmark clients (m=1000, tau=5, B=50)": (1000, 5, 50),
    "Table 4 clients (m=5000, tau=10, B=500)": (5000, 10, 500),
}
"""Name: (records per client, local steps, batch size)."""


def measure_vectorised(clients: int, records: int, local_steps: int, batch: int, rounds: int,
                       private: bool = True, device: str = "cpu", clock: str = "cpu") -> dict:
    """Seconds of a round's local training of ``clients`` clients, vectorised and one by one.

    Parameters
    ----------
    clients : int
        Clients hosted by the executor, all in every round's cohort.
    records, local_steps, batch : int
        m, tau and B of every client (federated PCA on Gr(40, 4)).
    rounds : int
        Timed rounds of each executor, alternating (after one untimed round each).
    private : bool
        The private step (sigma = 0.5) or the non-private baseline.
    device : str
        Torch device of the model and data.
    clock : str
        ``cpu`` (this process's CPU time) or ``wall`` (on a GPU).

    Returns
    -------
    dict
        ``vectorised_s`` and ``one_by_one_s`` (medians), ``speedup`` (ratio of the medians),
        ``speedup_min`` (ratio of the minima) and ``peak_device_mib`` (the most memory torch held on
        a CUDA device during the run; 0 on the CPU).
    """
    overrides = [
        f"federation.n_clients={clients}", f"federation.clients_per_round={clients}",
        f"federation.local_steps={local_steps}", f"federation.batch_size={batch}", "data.options.d=40",
        "data.options.p=4", f"data.options.records_per_client={records}", "privacy.noise_seed=0",
        f"privacy.enabled={private}", "privacy.sigma=0.5", "privacy.epsilon=null",
    ]
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, overrides + [f"run.output_dir={out}"])
        fed = Federation.prepare(cfg, RunDirectory.create(out, "bench"))
    plan = local_plan(cfg, fed.privacy)
    dataset = fed.dataset
    theta = {g: v.to(device) for g, v in initial_params(cfg, fed.model).items()}
    executors = {
        "vectorised": LocalExecutor(cfg, _on_device(dataset, device), fed.model, plan),
        "one_by_one": LocalExecutor(cfg, _on_device(dataset, device), fed.model, plan, vectorise=False),
    }
    cohort = list(range(clients))
    times: dict[str, list[float]] = {name: [] for name in executors}
    for t in range(rounds + 1):
        for name, ex in executors.items():
            synchronize(device)
            start = CLOCKS[clock]()
            ex.train(cohort, theta, t, {})
            synchronize(device)
            if t > 0:
                times[name].append(CLOCKS[clock]() - start)
    vec, one = statistics.median(times["vectorised"]), statistics.median(times["one_by_one"])
    peak = torch.cuda.max_memory_allocated(device) / 1024**2 if torch.device(device).type == "cuda" else 0.0
    return {"vectorised_s": vec, "one_by_one_s": one, "speedup": one / vec,
            "speedup_min": min(times["one_by_one"]) / min(times["vectorised"]), "peak_device_mib": peak}


def _on_device(dataset, device: str):
    if torch.device(device).type == "cpu":
        return dataset
    from actors.client_actor import DeviceDataset

    return DeviceDataset(dataset, torch.device(device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.clients} clients per executor, federated PCA Gr(40,4), private step; CPU seconds per round "
          f"(median of {args.rounds}, interleaved), {args.threads} thread(s)")
    print(f"{'setting':<46}{'vectorised s':>14}{'one by one s':>14}{'speedup':>9}{'(min)':>7}")
    for name, (records, tau, batch) in SETTINGS.items():
        r = measure_vectorised(args.clients, records, tau, batch, args.rounds)
        print(f"{name:<46}{r['vectorised_s']:>14.4f}{r['one_by_one_s']:>14.4f}{r['speedup']:>8.2f}x"
              f"{r['speedup_min']:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
