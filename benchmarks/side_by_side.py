"""rfedray against Flower 1.42 on the same two workloads, alternated in one run: start-up, round, memory.

Workloads (the Flower side is :mod:`flower.workloads`, written as a Flower user would):

* ``fedpca``: record-level DP federated PCA on Gr(40, 4), m = 5000 unit-norm records per client,
  tau = 10, B = 500, C = 0.355, sigma = 0.0242 fixed, step 0.2, ProjAvg, k = n/5 clients a round.
  rfedray: ``configs/fedpca.yaml`` with these overrides (records from ``synthetic_pca``); Flower:
  the same maths, records regenerated from the client id inside every fit.
* ``spdnet``: record-level DP SPDNet on EEG covariances, St(22, 16) x a (4, 137) head as for
  BNCI2014_001, B = 64, tau = 5, C = 1, sigma = 0.05 fixed, RSGD 0.01, ProjAvg, k = n/5. The
  records (216 covariances of 22 x 22 per client, from rfedray's synthetic EEG trials) are written
  once per n to an ``.npz``: rfedray reads it with ``data.source: arrays``, each Flower client reads
  its own arrays from it inside every fit. Per-record gradients have no closed form here: Flower
  uses ``vmap(grad)`` through ``eigh``.

For each workload and n, the engines run one after the other (rfedray's Ray engine, then Flower;
``--engines`` adds rfedray's local engine), each as a fresh process tree started from the command
line, with evaluation off for Flower and at the last round only for rfedray, on the server's test set
(``run.test_set: server``; the default, each client on its own test split with a secure sum,
starts two share-aggregator actors). Per run:

* start-up: process start to the end of the first round (Flower: its first ``aggregate_fit``;
  rfedray: its first line of ``metrics.jsonl``), and for rfedray the phases its ``--verbose`` log
  times (imports, federation prepared, Ray started, client actors up);
* round: the median of rounds 2..R (rfedray's ``round_seconds``; Flower's time between consecutive
  ``aggregate_fit`` ends);
* peak RSS: the largest sum of the resident set sizes of every process of the run (driver, actors,
  Ray's own processes), sampled every 0.1 s (:mod:`procmem`), and the breakdown by process role at
  that moment.

``--engines ray-before --baseline DIR`` adds rfedray's Ray engine from another checkout (an earlier
commit, run with this environment through ``PYTHONPATH``): before and after a change, in one run.

It prints one table row per run with the ratios rfedray / Flower of the same n, writes every run
(with its per-process breakdown) to ``OUT/runs.jsonl`` and the table to ``OUT/table.md``.

Flower needs its own environment (it pins ``ray==2.55.1``; rfedray pins another Ray):
``bash scripts/setup.sh --flower`` makes ``.venv-flower`` from ``benchmarks/flower/constraints.txt``.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/side_by_side.py [--sizes 10 100 500] [--rounds 6]
        [--workloads fedpca spdnet] [--engines ray flower] [--repeats 1] [--out DIR]
        [--engines ray-before ray flower --baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import yaml

from procmem import run_sampled

ROOT = Path(__file__).resolve().parent.parent
ATTEMPTS = 2
"""Runs of each command before the benchmark gives up (Ray's start can time out on a busy machine)."""
FLOWER_DIR = Path(__file__).resolve().parent / "flower"

FEDPCA = {
    "federation": {"local_steps": 10, "batch_size": 500},
    "data": {"source": "synthetic_pca", "options": {"d": 40, "p": 4, "records_per_client": 5000}},
    "privacy": {"sigma": 0.0242, "clip": 0.355, "epsilon": 1000.0},
    "optim": {"default": {"name": "rsgd", "lr": 0.2}},
    "aggregation": {"scheme": "projavg"},
}
"""rfedray's side of ``fedpca``: overrides of ``configs/fedpca.yaml``."""

SPDNET_TRIALS, SPDNET_TRAIN, SPDNET_TEST, SPDNET_TIMES = 288, 216, 200, 128
SPDNET = {
    "run": {"test_set": "server"},  # as federated PCA: Flower's harness evaluates nothing (see the README)
    "federation": {"local_steps": 5, "batch_size": 64},
    "privacy": {"enabled": True, "sigma": 0.05, "clip": 1.0, "epsilon": 1000.0, "delta": 1e-5, "accountant": "exact"},
    "model": {"name": "spdnet", "options": {"d": 16, "eps_reeig": 8e-5}},
    "aggregation": {"scheme": "projavg"},
    "optim": {"bimap": {"name": "rsgd", "lr": 0.01}, "head": {"name": "sgd", "lr": 0.01}},
}
"""rfedray's side of ``spdnet`` (with ``data.source: arrays`` on the written ``.npz``)."""


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def spdnet_file(n: int, out: Path) -> Path:
    """Every client's EEG covariances for n clients (and a test set), written once per n.

    Client i's records: the first 216 of 288 synthetic 22-channel trials of rfedray's
    ``synthetic_eeg`` source (4 classes, 128 samples), as sample covariances divided by their mean
    eigenvalue (:mod:`rfedray.data.eeg`'s normalisation), float32; ``x_test``: 200 trials of client n.
    """
    path = out / f"spdnet-covariances-{n}.npz"
    if path.exists():
        return path
    from rfedray.data.synthetic_eeg import Options, SyntheticEEG

    source = SyntheticEEG(Options(channels=22, num_classes=4, trials_per_client=SPDNET_TRIALS, n_times=SPDNET_TIMES),
                          n_clients=n + 1, seed=0)

    def covariances(client: int) -> tuple[np.ndarray, np.ndarray]:
        trials, labels = source.trials(client)
        cov = trials @ trials.transpose(0, 2, 1) / trials.shape[-1]
        cov /= np.trace(cov, axis1=1, axis2=2)[:, None, None] / cov.shape[-1]
        return cov.astype(np.float32), labels.astype(np.int64)

    arrays = {}
    for i in range(n):
        x, y = covariances(i)
        arrays[f"x_{i}"], arrays[f"y_{i}"] = x[:SPDNET_TRAIN], y[:SPDNET_TRAIN]
    x, y = covariances(n)
    arrays["x_test"], arrays["y_test"] = x[:SPDNET_TEST], y[:SPDNET_TEST]
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.rename(path)
    return path


def rfedray_config(workload: str, n: int, k: int, rounds: int, out: Path, data: Optional[Path]) -> Path:
    """The configuration file of rfedray's run (written to ``out``)."""
    run = {"rounds": rounds, "evaluate_every": rounds, "checkpoint_every": rounds, "output_dir": str(out / "runs")}
    if workload == "fedpca":
        cfg = merge(yaml.safe_load((ROOT / "configs" / "fedpca.yaml").read_text()), FEDPCA)
    else:
        cfg = merge({"run": {"name": "spdnet", "seed": 0}}, SPDNET)
        cfg["data"] = {"source": "arrays", "options": {"path": str(data), "task": "classification",
                                                       "representation": "covariance", "num_classes": 4}}
    cfg = merge(cfg, {"run": run, "federation": {"n_clients": n, "clients_per_round": k}})
    path = out / f"rfedray-{workload}-{n}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


STARTUP = re.compile(r"start-up: (.+?) at ([0-9.]+) s(?:, ([0-9]+) MiB resident)?$", re.M)
"""rfedray's ``--verbose`` start-up lines (:func:`rfedray.progress.log_startup`)."""


class FirstRecord:
    """Notes when the first ``metrics.jsonl`` line of a new run directory under ``root`` appears."""

    def __init__(self, root: Path):
        self.root, self.seconds = root, None
        self.before = set(root.iterdir())

    def __call__(self, seconds: float) -> None:
        if self.seconds is None and any(p.stat().st_size > 0 for p in self.root.glob("*/metrics.jsonl")
                                        if p.parent not in self.before):
            self.seconds = seconds


def run_rfedray(engine: str, workload: str, n: int, k: int, rounds: int, out: Path, data: Optional[Path],
                baseline: Optional[str] = None) -> dict:
    """rfedray's run; ``baseline``: the code of that checkout instead of this one (same environment)."""
    config = rfedray_config(workload, n, k, rounds, out, data)
    runs = out / "runs"
    runs.mkdir(exist_ok=True)
    rfedray = str(Path(sys.executable).parent / "rfedray")
    cmd = [rfedray, "run", str(config), "--quiet", "--verbose", "--engine", engine]
    env = dict(os.environ, PYTHONPATH=baseline) if baseline else None
    for attempt in range(ATTEMPTS):
        first = FirstRecord(runs)
        # In the checkout whose code runs: Ray puts the driver's working directory first on its workers' path.
        result = run_sampled(cmd, str(out / "last.log"), cwd=baseline or str(ROOT), env=env, watch=first)
        if result.returncode == 0:
            break
        print(f"    rfedray failed (exit {result.returncode}), attempt {attempt + 1} of {ATTEMPTS}:\n"
              f"{result.output[-1500:]}", file=sys.stderr, flush=True)
    else:
        raise SystemExit("rfedray failed every attempt")
    (run_dir,) = set(runs.iterdir()) - first.before
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds_s = [r["round_seconds"] for r in records if "round_seconds" in r]
    lines = list(STARTUP.finditer(result.output))
    phases = {m.group(1): float(m.group(2)) for m in lines}
    phases["first round done"] = first.seconds
    driver_mib = {m.group(1): int(m.group(3)) for m in lines if m.group(3)}
    return {"engine": f"rfedray-{engine}" + ("-before" if baseline else ""), "startup_s": first.seconds, "round_s": statistics.median(rounds_s[1:]),
            "rounds_s": rounds_s, "peak": result.peak, "wall_s": result.seconds, "phases": phases,
            "driver_mib": driver_mib,
            "command": " ".join(cmd[1:])}


def run_flower(python: str, workload: str, n: int, k: int, rounds: int, out: Path, data: Optional[Path]) -> dict:
    cmd = [python, "app.py", workload, str(n), str(k), str(rounds), "--ray-tmp", str(out / "ray-flower")]
    if data is not None:
        cmd += ["--data", str(data)]
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", PYTHONPATH=str(FLOWER_DIR))
    for attempt in range(ATTEMPTS):
        result = run_sampled(cmd, str(out / "last.log"), cwd=str(FLOWER_DIR), env=env)
        lines = [line for line in result.output.splitlines() if line.startswith("RESULT ")]
        if result.returncode == 0 and lines:
            break
        print(f"    Flower failed (exit {result.returncode}), attempt {attempt + 1} of {ATTEMPTS}:\n"
              f"{result.output[-1500:]}", file=sys.stderr, flush=True)
    else:
        raise SystemExit("Flower failed every attempt")
    res = json.loads(lines[-1][len("RESULT "):])
    return {"engine": "flower", "startup_s": res["round_ends"][0], "round_s": statistics.median(res["rounds"]),
            "rounds_s": res["rounds"], "peak": result.peak, "wall_s": result.seconds,
            "command": " ".join(cmd[1:])}


def breakdown(peak) -> str:
    """``driver 420 | ray::ClientActor 2x468 | ...`` (MiB of RSS at the peak, by role)."""
    parts = []
    for name, r in peak.by_role().items():
        count = f"{r['count']}x" if r["count"] > 1 else ""
        parts.append(f"{name} {count}{r['rss_mib'] / r['count']:.0f}")
    return " | ".join(parts)


def drop_page_cache() -> bool:
    """Write back and drop the kernel's page cache (root only); False where not allowed.

    The RSS of a process counts the pages of its shared libraries that it maps, and a page fault on a
    file that is in the page cache maps the cached pages around it too (fault-around). So the same
    ``import torch`` is 219 MiB of RSS after the cache was dropped and 272 MiB just after torch was
    installed (every page of it cached): without a common starting state, the side whose environment
    was written or read last looks larger.
    """
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workloads", nargs="+", choices=["fedpca", "spdnet"], default=["fedpca", "spdnet"])
    parser.add_argument("--engines", nargs="+", choices=["ray", "local", "flower", "ray-before"], default=["ray", "flower"],
                        help="ray-before: rfedray's Ray engine from the --baseline checkout")
    parser.add_argument("--baseline", default=None,
                        help="a checkout of an earlier rfedray commit, run with this environment (PYTHONPATH)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each engine per n (medians reported)")
    parser.add_argument("--flower-python", default=str(ROOT / ".venv-flower" / "bin" / "python"))
    parser.add_argument("--out", default=None, help="folder of the runs (default: a new temporary one)")
    args = parser.parse_args()
    # Absolute, not resolved: Flower runs in its own folder, and a venv's python is a link to the base
    # interpreter (resolving it would leave the venv).
    args.flower_python = os.path.abspath(args.flower_python)
    args.baseline = args.baseline and os.path.abspath(args.baseline)
    if "ray-before" in args.engines and not (args.baseline and (Path(args.baseline) / "rfedray").is_dir()):
        sys.exit(f"error: --baseline: {args.baseline!r} is not an rfedray checkout (needed by --engines ray-before)")
    if "flower" in args.engines and not Path(args.flower_python).is_file():
        sys.exit(f"error: --flower-python: {args.flower_python} not found; run `bash scripts/setup.sh --flower` "
                 "(Flower's own environment, .venv-flower)")
    out = Path(args.out or tempfile.mkdtemp(prefix="side-by-side-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}; runs in {out}",
          flush=True)
    cold = drop_page_cache()
    print("# the page cache is dropped before every run: each starts with its libraries on disk" if cold else
          "# the page cache could not be dropped (not root): a library just written or read is mapped in larger "
          "pieces, so the RSS of each side depends on what the cache holds (up to +50 MiB per process importing torch)",
          flush=True)
    rows: list[dict] = []
    with open(out / "runs.jsonl", "a") as log:
        for workload in args.workloads:
            for n in args.sizes:
                k = max(1, n // 5)
                data = spdnet_file(n, out) if workload == "spdnet" else None
                for rep in range(args.repeats):
                    for engine in args.engines:
                        if cold:
                            drop_page_cache()
                        if engine == "flower":
                            r = run_flower(args.flower_python, workload, n, k, args.rounds, out, data)
                        elif engine == "ray-before":
                            r = run_rfedray("ray", workload, n, k, args.rounds, out, data, args.baseline)
                        else:
                            r = run_rfedray(engine, workload, n, k, args.rounds, out, data)
                        r.update(workload=workload, n=n, k=k, repeat=rep, peak_rss_mib=r["peak"].rss / 2**20,
                                 processes=r["peak"].by_role(), load=psutil.getloadavg()[0])
                        print(f"  {workload} n={n} {r['engine']}: start-up {r['startup_s']:.1f} s, round "
                              f"{r['round_s']:.3f} s, peak RSS {r['peak_rss_mib']:.0f} MiB ({breakdown(r['peak'])})",
                              flush=True)
                        if r.get("phases"):
                            print("    start-up phases (s since the process started): "
                                  + "; ".join(f"{name} {t:.1f}" for name, t in r["phases"].items()), flush=True)
                        if r.get("driver_mib"):
                            print("    the driver's resident memory then (MiB): "
                                  + "; ".join(f"{name} {m}" for name, m in r["driver_mib"].items()), flush=True)
                        log.write(json.dumps({key: v for key, v in r.items() if key != "peak"}) + "\n")
                        log.flush()
                        rows.append(r)
    table = render(rows, args.engines)
    (out / "table.md").write_text(table)
    print(table)


def render(rows: list[dict], engines: list[str]) -> str:
    """The Markdown table: medians per (workload, n, engine), ratios to Flower's of the same n."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["n"], r["engine"]), []).append(r)

    def med(key: tuple, field: str) -> float:
        return statistics.median(r[field] for r in groups[key])

    lines = ["| workload | n | k | engine | start-up s | x Flower | round s | x Flower | peak RSS MiB | x Flower |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = [e if e == "flower" else f"rfedray-{e}" for e in engines]  # ray-before -> rfedray-ray-before
    for workload, n in sorted({(w, n) for w, n, _ in groups}, key=lambda wn: (wn[0] != "fedpca", wn[1])):
        flower = (workload, n, "flower")
        for engine in order:
            key = (workload, n, engine)
            if key not in groups:
                continue
            cells = []
            for field, fmt in (("startup_s", "{:.1f}"), ("round_s", "{:.3f}"), ("peak_rss_mib", "{:.0f}")):
                value = med(key, field)
                ratio = f"{value / med(flower, field):.2f}" if flower in groups else "-"
                cells += [fmt.format(value), ratio]
            lines.append(f"| {workload} | {n} | {groups[key][0]['k']} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
