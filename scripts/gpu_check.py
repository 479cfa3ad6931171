"""GPU check of the Ray engine: 8 client actors share one GPU and train federated PCA on it.

Each client actor asks Ray for 0.125 GPU (fractional GPUs pack the 8 actors on one device; Ray caps
no memory) and ``ray.device=cuda``; the script prints every actor's node, process, GPU ids and torch
device, runs a few private rounds, and prints the summary.

Run on a machine with a CUDA GPU: ``python scripts/gpu_check.py [--rounds 5] [--clients 32]``.
Exit status 0 when every actor trained on CUDA and no client failed, 1 otherwise. A dry run of the
script on a CPU machine: ``--device cpu --gpus-per-actor 0``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

from actors.engine import ray_executor
from rfedray.config import load_config
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory, new_run_id

ACTORS = 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpus-per-actor", type=float, default=1 / ACTORS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch: run this on a GPU machine", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            "run.engine=ray", f"run.rounds={args.rounds}", f"run.output_dir={out}", "monitoring.progress=false",
            f"federation.n_clients={args.clients}", f"federation.clients_per_round={args.clients // 2}",
            f"ray.num_client_actors={ACTORS}", f"ray.num_gpus_per_actor={args.gpus_per_actor}",
            "ray.num_cpus_per_actor=0.25", f"ray.device={args.device}", "privacy.sigma=0.5", "privacy.epsilon=null",
        ])
        fed = Federation.prepare(cfg, RunDirectory.create(out, new_run_id("gpu-check")))
        executor = ray_executor(fed)
        try:
            actors = executor.describe()
            for slot, info in enumerate(actors):
                print(f"client actor {slot}: node {info['node_id'][:12]} pid {info['pid']} gpu_ids {info['gpu_ids']} "
                      f"device {info['device']} clients {info['clients'][0]}-{info['clients'][-1]}")
            summary = fed.run(executor)
        finally:
            executor.close()
    print(json.dumps({k: summary[k] for k in ("rounds_completed", "client_failures", "epsilon_spent", "final_metrics")}))
    on_device = all(info["device"].startswith(args.device) for info in actors)
    ok = on_device and summary["client_failures"] == 0 and summary["rounds_completed"] == args.rounds
    print("OK" if ok else f"FAILED: every actor on {args.device}: {on_device}; client failures: {summary['client_failures']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
