"""The GPU checks of rfedray's performance, as one short script.

Sections (wall clock, every CUDA call synchronised before a timer stops):

* private against non-private step on the device: SPDNet 22 -> 16 (B = 64) and federated PCA on
  Gr(40, 4) (B = 500), from ``bench_eeg_step``;
* 16 clients packed on one GPU: one executor training them together against one by one (the
  speedup, and the peak device memory of the run), from ``bench_batched``;
* the same 16 clients on the Ray engine: 16 client actors of one client each sharing the GPU
  (``ray.num_gpus_per_actor = 1/16``) against one actor hosting all 16 on the whole GPU, from
  ``bench_engines`` (starts a local Ray instance; ``--no-ray`` leaves it out).

About 3 minutes on one GPU with the defaults (it prints the elapsed time at the end).
``--device cpu`` runs everything on the CPU (fewer clients with ``--clients``), as a smoke check on
machines without a GPU; its numbers say nothing about a GPU.

Run: ``python benchmarks/gpu_suite.py [--device cuda] [--clients 16] [--repeats 20] [--rounds 6] [--no-ray]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from bench_batched import measure_vectorised
from bench_eeg_step import measure_case
from bench_engines import measure_engine


def step_lines(device: str, repeats: int) -> list[str]:
    lines = []
    for name in ("spdnet", "fedpca"):
        r = measure_case(name, repeats, clock="wall", device=device)
        lines.append(f"{r['case']:<28} non-private {r['nonprivate_ms']:8.2f} ms  private {r['private_ms']:8.2f} ms  "
                     f"ratio {r['ratio']:5.2f}x (min {r['ratio_min']:.2f}x, goal <= {r['goal']:g}x)")
    return lines


def packing_lines(device: str, clients: int, rounds: int) -> list[str]:
    r = measure_vectorised(clients, 1000, 5, 50, rounds, device=device, clock="wall")
    return [f"{clients} clients on one {device} executor (FedPCA Gr(40,4), m=1000, tau=5, B=50): together "
            f"{r['vectorised_s'] * 1e3:.1f} ms, one by one {r['one_by_one_s'] * 1e3:.1f} ms per round, speedup "
            f"{r['speedup']:.2f}x (min {r['speedup_min']:.2f}x); peak device memory {r['peak_device_mib']:.0f} MiB"]


def ray_lines(device: str, clients: int, rounds: int) -> list[str]:
    gpu = torch.device(device).type == "cuda"
    common = [f"ray.device={'cuda' if gpu else 'cpu'}", "federation.clients_per_round=" + str(clients)]
    layouts = {
        f"{clients} actors x 1 client sharing one {device}": [
            f"ray.num_client_actors={clients}", f"ray.num_gpus_per_actor={1 / clients if gpu else 0}",
            f"ray.num_cpus_per_actor={1 if gpu else 0}"],
        f"1 actor x {clients} clients on one {device}": [
            "ray.num_client_actors=1", f"ray.num_gpus_per_actor={1 if gpu else 0}", "ray.num_cpus_per_actor=1"],
    }
    lines = []
    with tempfile.TemporaryDirectory() as out:
        for name, overrides in layouts.items():
            r = measure_engine("ray", clients, clients, rounds, out, *common, *overrides)
            lines.append(f"Ray engine, {name}: round {r['round_s'] * 1e3:.1f} ms, training "
                         f"{r['train_s'] * 1e3:.1f} ms, {r['failed']} dropouts, peak RSS of all Ray processes "
                         f"{r['peak_rss_gib']:.2f} GiB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; cpu for a smoke check)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray section (16 actors sharing the device)")
    args = parser.parse_args()
    start = time.perf_counter()
    gpu = torch.device(args.device).type == "cuda"
    if gpu and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device}: torch sees no CUDA device (use --device cpu for a smoke check)")
    torch.set_num_threads(1)
    name = torch.cuda.get_device_name(args.device) if gpu else "CPU (smoke check only)"
    print(f"# {name}, torch {torch.__version__}", flush=True)
    for line in step_lines(args.device, args.repeats) + packing_lines(args.device, args.clients, args.rounds):
        print(line, flush=True)
    if not args.no_ray:
        for line in ray_lines(args.device, args.clients, args.rounds):
            print(line, flush=True)
    print(f"# {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
