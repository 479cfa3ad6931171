"""The studies' runs as Ray tasks: one task (one CPU) per run, across a local instance or a cluster."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import ray


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """Connected to (``ADDRESS``) or started (``local``) the Ray instance a study's tasks run on,
    for a block (``rfedray experiment ... ray=local|ADDRESS``); shut down after it."""
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def run_as_tasks(fn: Callable[[Any], dict], args: Sequence[Any], finished: Callable[[dict], None]) -> list[dict]:
    """``fn(a)`` for every ``a`` of ``args`` as Ray tasks of one CPU; ``finished`` gets each result as
    it ends; the results come back in the order of ``args``."""
    job = ray.remote(num_cpus=1)(fn)
    refs = [job.remote(a) for a in args]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        finished(ray.get(done[0]))
    return ray.get(refs)
