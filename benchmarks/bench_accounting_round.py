"""The accounting cost of a Ray round: calls from the federation loop to the accountant actor, and their time.

A private run on the Ray engine (6 clients, 3 per round, Gr(12, 2), exact accountant) in this
process: the loop holds the ledger the Ray executor gives it (a proxy of the accountant actor), and
this script wraps that ledger to count every call and time it. Each call is one round trip to the
actor. Prints calls per round by method, and milliseconds of accounting per round.

With ``--phases`` it also charges the same rounds in this process on the loop's own
:class:`~rfedray.federated.resume.WriteAheadLedger` (what the accountant actor runs) and splits a
round's milliseconds into phases: the ledger's charge (its epsilon), the writer-lock checks, JSON
encoding, each fsync (``budget.json``'s temporary file, the folder, ``ledger.jsonl``), the rename
and the rest (opening, writing, hashing); the Ray call is the Ray round's time less the in-process
one. ``--fsync`` times fsync alone on the same disk (a 1 KiB rewrite, a folder, a 100-byte append).

::

    python benchmarks/bench_accounting_round.py [--rounds 30] [--phases] [--fsync]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import tempfile
import time

import ray
import torch

from actors.engine import ray_executor
from rfedray.config import load_config
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory

RUN = ["federation.n_clients=6", "federation.clients_per_round=3", "federation.local_steps=3",
       "federation.batch_size=40", "data.options.d=12", "data.options.p=2", "data.options.records_per_client=300",
       "privacy.noise_seed=7", "privacy.sigma=0.5", "privacy.epsilon=null", "monitoring.progress=false",
       "run.engine=ray", "run.checkpoint_every=10"]


REST = "rest (open, write, hash, python)"


class Timed:
    """Counts and times every method call of the object it wraps."""

    def __init__(self, inner):
        self.inner, self.calls, self.seconds = inner, collections.Counter(), collections.Counter()
        self.each: dict[str, list[float]] = collections.defaultdict(list)

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.calls[name] += 1
                self.seconds[name] += time.perf_counter() - start
                self.each[name].append(time.perf_counter() - start)

        return timed


def measure(rounds: int) -> dict:
    """Run ``rounds`` rounds on Ray; calls and seconds of the loop's ledger, per method."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [*RUN, f"run.rounds={rounds}", f"run.output_dir={out}"])
        fed = Federation.prepare(cfg, RunDirectory.create(out, "accounting"))
        executor = ray_executor(fed)
        made = []
        remote = fed.ledger_factory
        fed.ledger_factory = lambda: made.append(Timed(remote())) or made[-1]
        try:
            summary = fed.run(executor)
        finally:
            executor.close()
    (ledger,) = made
    return {"rounds": summary["rounds_completed"], "calls": dict(ledger.calls), "seconds": dict(ledger.seconds),
            "authorize": ledger.each["authorize"]}


@contextlib.contextmanager
def phase_clock(ledger):
    """Patch the calls a charge makes (in this process only) so that each adds its seconds to a phase."""
    from rfedray.federated.rundir import RunDirectory

    seconds = collections.Counter()

    def timed(phase, function):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase(*args) if callable(phase) else phase] += time.perf_counter() - start
        return call

    def fsync_phase(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(target):
            return "fsync folder"
        return "fsync ledger.jsonl" if target.endswith("ledger.jsonl") else "fsync budget.json tmp"

    inner = ledger._ledger
    saved = (os.fsync, os.replace, json.dumps, RunDirectory.check_writer, inner.authorize)
    os.fsync, os.replace = timed(fsync_phase, os.fsync), timed("rename", os.replace)
    json.dumps = timed("JSON encode", json.dumps)
    RunDirectory.check_writer = timed("lock check", RunDirectory.check_writer)
    inner.authorize = timed("charge (epsilon)", inner.authorize)
    try:
        yield seconds
    finally:
        os.fsync, os.replace, json.dumps, RunDirectory.check_writer = saved[:4]
        del inner.authorize


def measure_phases(rounds: int) -> dict:
    """Charge ``rounds`` rounds of the benchmark's run on its WriteAheadLedger in this process; seconds per phase."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [*RUN, f"run.rounds={rounds}", f"run.output_dir={out}"])
        fed = Federation.prepare(cfg, RunDirectory.create(out, "phases"))
        ledger = fed.write_ahead_ledger()
        ledger.start()
        cohorts = [[(t + k) % cfg.federation.n_clients for k in range(cfg.federation.clients_per_round)]
                   for t in range(rounds)]
        with phase_clock(ledger) as seconds:
            start = time.perf_counter()
            for t, cohort in enumerate(cohorts):
                ledger.authorize(cohort, cfg.federation.local_steps, t, f"request-{t}")
                if t == 0:
                    first = dict(seconds)
                    first[REST] = time.perf_counter() - start - sum(first.values())
                    first["total"] = time.perf_counter() - start
            total = time.perf_counter() - start
    seconds[REST] = total - sum(seconds.values())
    return {"total": total, "seconds": dict(seconds), "first": first}


def measure_fsync(repeats: int = 200) -> dict:
    """Milliseconds of fsync alone in a temporary folder of this disk (median of ``repeats``)."""
    import statistics

    times = collections.defaultdict(list)

    def sync_after_write(label: str, path: str, mode: str, data: bytes, sync) -> None:
        with open(path, mode) as fh:
            fh.write(data)
            fh.flush()
            start = time.perf_counter()
            sync(fh.fileno())
            times[label].append(time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as out:
        log_path, file_path = os.path.join(out, "log"), os.path.join(out, "file")
        for _ in range(repeats):
            sync_after_write("fsync 1 KiB new file", file_path, "wb", b"x" * 1024, os.fsync)
            sync_after_write("fdatasync 1 KiB new file", file_path, "wb", b"x" * 1024, os.fdatasync)
            fd = os.open(out, os.O_RDONLY)
            try:
                start = time.perf_counter()
                os.fsync(fd)
                times["fsync folder"].append(time.perf_counter() - start)
            finally:
                os.close(fd)
            sync_after_write("fsync 100 B append", log_path, "ab", b"y" * 100, os.fsync)
            sync_after_write("fdatasync 100 B append", log_path, "ab", b"y" * 100, os.fdatasync)
    return {k: round(1000 * statistics.median(v), 3) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--phases", action="store_true", help="split a round's accounting into phases (in this process)")
    parser.add_argument("--fsync", action="store_true", help="time fsync alone on this disk")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fsync:
        print(f"fsync alone, median ms: {measure_fsync()}")
    if args.phases:
        phases = measure_phases(args.rounds)
        per_round = {k: round(1000 * v / args.rounds, 2) for k, v in sorted(phases["seconds"].items(), key=lambda kv: -kv[1])}
        print(f"in this process: {1000 * phases['total'] / args.rounds:.2f} ms of accounting per round, by phase {per_round}")
        print(f"  of which round 0, ms: { {k: round(1000 * v, 2) for k, v in phases['first'].items()} }")
        rest = {k: v - phases["first"].get(k, 0.0) for k, v in phases["seconds"].items()}
        rest_total = phases["total"] - phases["first"]["total"]
        print(f"  rounds 1-{args.rounds - 1}: {1000 * rest_total / (args.rounds - 1):.2f} ms per round, by phase "
              f"{ {k: round(1000 * v / (args.rounds - 1), 3) for k, v in sorted(rest.items(), key=lambda kv: -kv[1])} }")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        result = measure(args.rounds)
    finally:
        ray.shutdown()
    rounds, calls, seconds = result["rounds"], result["calls"], result["seconds"]
    per_call = {k: round(1000 * seconds[k] / calls[k], 2) for k in calls}
    print(f"rounds {rounds}: {sum(calls.values()) / rounds:.2f} accountant round trips per round {calls}, "
          f"{1000 * sum(seconds.values()) / rounds:.2f} ms of accounting per round (ms per call {per_call})")
    each = sorted(result["authorize"][1:])
    print(f"authorize: round 0 {1000 * result['authorize'][0]:.2f} ms; the other rounds median "
          f"{1000 * each[len(each) // 2]:.2f} ms, max {1000 * each[-1]:.2f} ms")


if __name__ == "__main__":
    main()
