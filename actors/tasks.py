"""The studies' runs as Ray tasks: one task (one CPU) per run, across a local instance or a cluster."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import ray


class StudySession:
    """A Ray connection opened for a study (``rfedray experiment ... ray=local|ADDRESS``), closed after it."""

    def __init__(self, address: str):
        ray.init(address=address, include_dashboard=False, log_to_driver=False)

    def close(self) -> None:
        ray.shutdown()


def connect(address: str) -> StudySession:
    """Connect to (``ADDRESS``) or start (``local``) the Ray instance a study's tasks run on."""
    return StudySession(address)


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
