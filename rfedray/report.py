"""Plots of a run directory: the utility metric and epsilon spent against the round.

Written at the end of every run and on demand by ``rfedray report RUN_DIR``.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from rfedray.errors import RfedrayError
from rfedray.federated.rundir import RunDirectory

PRIMARY = ("accuracy", "gap", "loss", "distance")
PLOTTED = (*PRIMARY, *(f"oracle_{m}" for m in PRIMARY))
"""The metrics plotted, held-out ones and oracle ones (computed from the training records), by name."""


def _rounds(run_dir: RunDirectory) -> list[dict]:
    if not run_dir.is_file("metrics.jsonl"):
        raise RfedrayError(f"report {run_dir.path}: no metrics.jsonl there; is it a run directory?")
    return [r for r in run_dir.read_metrics(tolerant=True) if "event" not in r]


def _save(fig, run_dir: RunDirectory, name: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    run_dir.write_bytes(name, buffer.getvalue())
    return str(run_dir.store.where(name))


def write_plots(run_dir: "str | Path | RunDirectory") -> list[str]:
    """``utility.png`` (each metric against the round) and ``epsilon.png`` (budget against round).

    ``run_dir`` may be a folder, an object-storage URL or a :class:`RunDirectory` (whose writer
    token is then used).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(run_dir, RunDirectory):
        run_dir = RunDirectory(run_dir)
    records = _rounds(run_dir)
    if not records:
        return []
    summary = json.loads(run_dir.read_bytes("summary.json")) if run_dir.is_file("summary.json") else {}
    rounds = [r["round"] + 1 for r in records]
    names = [m for m in PLOTTED if f"metric_{m}" in records[-1]]
    written = []
    if names:
        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.3), squeeze=False)
        for ax, name in zip(axes[0], names):
            values = [r.get(f"metric_{name}") for r in records]
            ax.plot(rounds, values)
            if name.removeprefix("oracle_") in ("gap", "distance") and all(v is not None and v > 0 for v in values):
                ax.set_yscale("log")
            ax.set_xlabel("round")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{run_dir.run_id}", fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, run_dir, "utility.png"))
        plt.close(fig)
    eps = [r["epsilon_spent"] for r in records]
    if any(e is not None for e in eps):
        fig, ax = plt.subplots(figsize=(4.5, 3.3))
        ax.plot(rounds, eps, label="epsilon spent (max over clients)")
        target = summary.get("epsilon_target")
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", label=f"target {target:g}")
        ax.set_xlabel("round")
        ax.set_ylabel("epsilon")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, run_dir, "epsilon.png"))
        plt.close(fig)
    return written


def cmd_report(args: argparse.Namespace) -> int:
    for path in write_plots(args.run_dir):
        print(path)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("report", help="plot a run directory's metrics",
                                   description="Write utility.png and epsilon.png into RUN_DIR.")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.set_defaults(func=cmd_report)
