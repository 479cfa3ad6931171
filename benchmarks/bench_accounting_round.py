"""The accounting cost of a Ray round: calls from the federation loop to the accountant actor, and their time.

A private run on the Ray engine (6 clients, 3 per round, Gr(12, 2), exact accountant) in this
process: the loop holds the ledger the Ray executor gives it (a proxy of the accountant actor), and
this script wraps that ledger to count every call and time it. Each call is one round trip to the
actor. Prints calls per round by method, and milliseconds of accounting per round.

::

    python benchmarks/bench_accounting_round.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import collections
import logging
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


class Timed:
    """Counts and times every method call of the object it wraps."""

    def __init__(self, inner):
        self.inner, self.calls, self.seconds = inner, collections.Counter(), collections.Counter()

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.calls[name] += 1
                self.seconds[name] += time.perf_counter() - start

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
    return {"rounds": summary["rounds_completed"], "calls": dict(ledger.calls), "seconds": dict(ledger.seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        result = measure(args.rounds)
    finally:
        ray.shutdown()
    rounds, calls, seconds = result["rounds"], result["calls"], result["seconds"]
    per_call = {k: round(1000 * seconds[k] / calls[k], 2) for k in calls}
    print(f"rounds {rounds}: {sum(calls.values()) / rounds:.2f} accountant round trips per round {calls}, "
          f"{1000 * sum(seconds.values()) / rounds:.2f} ms of accounting per round (ms per call {per_call})")


if __name__ == "__main__":
    main()
