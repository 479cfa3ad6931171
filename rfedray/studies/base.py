"""What every study shares: running many federations, summarising over seeds, writing the report.

A study is a small class with a name, a description, its expected run time, and a ``run`` method
that returns :class:`Table` objects; :func:`write_outputs` turns them into ``results.csv``,
``results.json`` and ``report.md`` (every number beside the paper's value and the difference).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import socket
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rfedray.progress import bar

SCALES = ("tiny", "full")


@dataclass
class Row:
    """One line of a result table: a label, our numbers and (optionally) the paper's."""

    label: dict[str, Any]
    ours: dict[str, Any]
    paper: dict[str, Any] = field(default_factory=dict)


@dataclass
class Table:
    """A titled table of rows, rendered as markdown with paper values and differences."""

    title: str
    rows: list[Row]
    note: str = ""

    def markdown(self) -> str:
        label_keys = list(self.rows[0].label) if self.rows else []
        value_keys = list(dict.fromkeys(k for r in self.rows for k in r.ours))
        header = label_keys + [h for k in value_keys for h in (k, f"paper {k}", "diff")]
        lines = [f"### {self.title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in self.rows:
            cells = [str(r.label[k]) for k in label_keys]
            for k in value_keys:
                ours, paper = r.ours.get(k), r.paper.get(k)
                cells += [fmt(ours), fmt(paper), diff(ours, paper)]
            lines.append("| " + " | ".join(cells) + " |")
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines) + "\n"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def diff(ours: Any, paper: Any) -> str:
    """Relative difference ``ours / paper - 1`` for a number, or the difference of a median."""
    mid = ours[0] if isinstance(ours, (tuple, list)) else ours
    if not isinstance(mid, (int, float)) or not isinstance(paper, (int, float)) or paper == 0:
        return "-"
    return f"{100 * (mid / paper - 1):+.1f}%"


def median_iqr(values: Sequence[float]) -> tuple[float, float, float]:
    """Median and interquartile range (quartiles by linear interpolation)."""
    if len(values) == 1:
        return (values[0], values[0], values[0])
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (statistics.median(values), q1, q3)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


class MedianIQR(tuple):
    """A (median, q1, q3) triple that prints as ``median [q1, q3]``."""

    def __str__(self) -> str:
        return f"{self[0]:.4g} [{self[1]:.4g}, {self[2]:.4g}]"


def fmt_median(values: Sequence[float]) -> MedianIQR:
    return MedianIQR(median_iqr(values))


def job_directory_name(overrides: Sequence[str]) -> str:
    """The run directory of one job of a study: a digest of its overrides, the same in every run of
    the study, so that a re-run in the same output directory finds the jobs already finished."""
    return "job-" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:16]


def _finished_summary(path: Path) -> Optional[dict]:
    """The summary of a job that ran to its end (all rounds, or halted at its budget), else None."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    done = summary.get("rounds_completed") == summary.get("rounds_planned") or summary.get("halted")
    return summary if done and summary.get("final_metrics") else None


def _run_one(job: tuple[list[str], str]) -> dict:
    """One job, on one torch thread (the same bits whatever the process, pool or Ray task that runs it)."""
    import torch

    from rfedray.config import load_config
    from rfedray.federated.loop import run_federation
    from rfedray.federated.rundir import RunDirectory

    torch.set_num_threads(1)
    overrides, output_dir = job
    path = Path(output_dir) / job_directory_name(overrides)
    summary = _finished_summary(path)
    if summary is not None:
        summary["reused"] = True
    else:
        if path.exists():
            shutil.rmtree(path)  # an unfinished run (the study was interrupted): run it again
        cfg = load_config(None, [*overrides, f"run.output_dir={output_dir}", "monitoring.progress=false"])
        summary = run_federation(cfg, RunDirectory.create(output_dir, path.name))
        summary["reused"] = False
    summary["run_dir"] = str(path)
    summary["ran_on"] = {"host": socket.gethostname(), "pid": os.getpid()}
    return summary


class _Progress:
    """Progress of a study's jobs: a ``tqdm`` bar on a terminal, else one stderr line per finished job
    (count, reused jobs, elapsed time, estimate of the rest from the mean time of the jobs run)."""

    def __init__(self, total: int):
        self.total, self.done, self.reused = total, 0, 0
        self.started = time.perf_counter()
        self.bar = bar(None, total=total, desc="study", unit="run")

    def finished(self, summary: dict) -> None:
        self.done += 1
        self.reused += bool(summary.get("reused"))
        ran = self.done - self.reused
        elapsed = time.perf_counter() - self.started
        rest = (self.total - self.done) * elapsed / ran if ran else float("nan")
        line = f"{self.done}/{self.total} runs ({self.reused} reused from an earlier run)"
        if self.bar.disable:
            print(f"study: {line}, {elapsed:.0f} s, about {rest / 60:.0f} min left", file=sys.stderr, flush=True)
        else:
            self.bar.set_postfix_str(f"{self.reused} reused", refresh=False)
            self.bar.update(1)
        if self.done == self.total:
            self.bar.close()


def run_many(jobs: Sequence[list[str]], output_dir: Path, workers: Optional[int] = None) -> list[dict]:
    """Run federations (each a list of overrides on the default config), ``workers`` at a time.

    Each federation runs with the local engine in its own process; the studies parallelise over
    runs (seeds, settings), which is what keeps a 2-core laptop busy. When this process is connected
    to Ray, every job is a Ray task instead (``workers`` is then the cluster's CPUs). Every job has its own run
    directory named by its overrides (:func:`job_directory_name`): a study interrupted and started
    again in the same output directory reuses the jobs that finished and runs the others afresh.
    Progress goes to stderr, one line per job.
    """
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    output_dir.mkdir(parents=True, exist_ok=True)
    args = [(list(job), str(output_dir)) for job in jobs]
    progress = _Progress(len(args))
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # ``rfedray experiment ... ray=local|ADDRESS``
        from actors.tasks import run_as_tasks

        return run_as_tasks(_run_one, args, progress.finished)
    if workers == 1:
        import torch

        threads = torch.get_num_threads()
        try:
            results = []
            for a in args:
                results.append(_run_one(a))
                progress.finished(results[-1])
            return results
        finally:
            torch.set_num_threads(threads)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run_one, a) for a in args]
        for future in as_completed(futures):
            progress.finished(future.result())
        return [f.result() for f in futures]


def run_grid(jobs: dict, output_dir: Path, workers: Optional[int] = None) -> dict:
    """:func:`run_many` over a mapping ``key -> overrides``; returns ``key -> summary``.

    Keys with the same overrides (two settings can make the same run, e.g. candidates that differ
    only in a value a scale caps) share one run, in one directory, and its summary."""
    distinct = list(dict.fromkeys(tuple(overrides) for overrides in jobs.values()))
    done = dict(zip(distinct, run_many([list(o) for o in distinct], output_dir, workers)))
    return {key: done[tuple(overrides)] for key, overrides in jobs.items()}


def write_outputs(out_dir: Path, title: str, tables: Sequence[Table], figures: Sequence[str] = (), preface: str = "") -> Path:
    """``results.json``, ``results.csv`` and ``report.md`` for a study; returns the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = [{"title": t.title, "rows": [{"label": r.label, "ours": _jsonable(r.ours), "paper": r.paper} for r in t.rows]} for t in tables]
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2))
    with open(out_dir / "results.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["table", "label", "quantity", "ours", "paper"])
        for t in tables:
            for r in t.rows:
                for k, v in r.ours.items():
                    writer.writerow([t.title, json.dumps(r.label), k, json.dumps(_jsonable(v)), r.paper.get(k)])
    parts = [f"# {title}", "", preface] if preface else [f"# {title}", ""]
    parts += [t.markdown() for t in tables]
    parts += [f"![{Path(f).stem}]({Path(f).name})" for f in figures]
    report = out_dir / "report.md"
    report.write_text("\n".join(parts) + "\n")
    return report


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> str:
    """Write ``fig`` to ``path`` (PNG, 120 dpi), close it and return the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return str(path)


def study_folder(scales: dict, scale: str, out_dir) -> tuple[Any, Path]:
    """The settings of ``scale`` (a key of ``scales``) and the output folder (created), for a study
    that trains in this process on one thread.

    Raises
    ------
    ValueError
        For a scale ``scales`` does not have.
    """
    import torch

    if scale not in scales:
        raise ValueError(f"scale={scale!r}: must be one of {', '.join(scales)}")
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return scales[scale], out


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """``rows`` (dicts with the same keys) as a CSV file with a header line."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
