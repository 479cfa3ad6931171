"""A Table 4 seed through the command line against the studies' run of it, side by side: threads.

One seed of federated PCA at the paper's Table 4 shapes (n = 50, k = 10, m = 5000, tau = 10,
B = 500, epsilon = 1), ``--rounds`` rounds, run four ways, alternated ``--repeats`` times, each a
fresh process:

* ``cli, torch's default threads``: ``rfedray run --engine local ... run.threads=<CPUs>`` (what the
  command line did before it chose its threads: torch's default is one thread per CPU);
* ``cli, chosen threads``: ``rfedray run --engine local ...`` (:mod:`rfedray.threads` chooses);
* ``cli, OMP_NUM_THREADS=1``: the same command with one OpenMP thread forced from outside;
* ``studies``: the same overrides through :func:`rfedray.studies.base.run_many` (one job, one
  worker: one torch thread, no plots), what ``rfedray experiment`` runs per seed.

Prints the median wall and CPU seconds (the process and its children) of each, and each one's
ratio to the studies' run.

Run: ``nice -n 10 python benchmarks/bench_threads.py [--rounds 20] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE4 = ["federation.n_clients=50", "federation.clients_per_round=10", "data.options.records_per_client=5000",
          "federation.local_steps=10", "federation.batch_size=500", "privacy.epsilon=1.0", "run.checkpoint_every=1000"]


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, with its children) of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    rfedray = str(Path(sys.executable).parent / "rfedray")
    with tempfile.TemporaryDirectory() as out:
        overrides = [*TABLE4, f"run.rounds={args.rounds}"]
        cli = [rfedray, "run", "--quiet", "--engine", "local", *overrides, f"run.output_dir={out}"]
        study = [sys.executable, "-c", "import sys; from pathlib import Path; from rfedray.studies.base import run_many; "
                 "run_many([sys.argv[2:]], Path(sys.argv[1]), workers=1)", "STUDY_DIR", *overrides]
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        variants = {
            f"cli, torch's default threads ({cpus})": (cli + [f"run.threads={cpus}"], base),
            "cli, chosen threads": (cli, base),
            "cli, OMP_NUM_THREADS=1": (cli, dict(base, OMP_NUM_THREADS="1")),
            "studies (run_many, 1 worker)": (study, base),
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for rep in range(args.repeats):
            for name, (cmd, env) in variants.items():
                cmd = [f"{out}/study-{rep}" if a == "STUDY_DIR" else a for a in cmd]  # fresh each time: no reuse
                times[name].append(timed(cmd, env))
    print(f"# Table 4 seed (n=50, k=10, m=5000, tau=10, B=500, epsilon=1), {args.rounds} rounds, {cpus} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, median of {args.repeats}")
    study_wall = statistics.median(w for w, _ in times["studies (run_many, 1 worker)"])
    study_cpu = statistics.median(c for _, c in times["studies (run_many, 1 worker)"])
    print("| run | wall s | x studies | CPU s | x studies |\n|---|---|---|---|---|")
    for name, values in times.items():
        wall, cpu = statistics.median(w for w, _ in values), statistics.median(c for _, c in values)
        print(f"| {name} | {wall:.1f} | {wall / study_wall:.2f} | {cpu:.1f} | {cpu / study_cpu:.2f} |")


if __name__ == "__main__":
    main()
