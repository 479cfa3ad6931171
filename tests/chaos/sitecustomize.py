"""The chaos test's side channels into a run: what the clients released, what the server combined, and
the dropouts of a replay.

On ``PYTHONPATH`` only for the chaos test's runs. Each process of a run (the driver, a Ray server or
client actor) loads it at start-up; it wraps functions of the engine-free core as their modules
are imported, and appends to the test's files with ``O_APPEND`` (one ``write`` per line group, so
lines of concurrent processes never mix):

``RFEDRAY_CHAOS_RELEASES=FILE``
    :meth:`rfedray.federated.executor.LocalExecutor.train` (which both engines use to train a
    cohort) appends ``round client`` for each client that answered, before the submissions leave
    the process: the releases, counted independently of everything the run writes.
``RFEDRAY_CHAOS_AGGREGATED=FILE``
    :meth:`rfedray.federated.server.Server.aggregate` appends ``round client client ...``: the
    clients whose submissions went into round ``round``'s update (the round is the last one whose
    cohort the loop drew in that process). The last line of a round is the execution the run kept.
``RFEDRAY_CHAOS_FAIL=round:client,client;round:client``
    ``LocalExecutor.train`` turns those clients' results into dropouts: a local run that replays
    the dropouts of a chaos trial (client actors killed mid-round).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


def _append(path: str, lines: list[str]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
    finally:
        os.close(fd)


def _failures() -> dict[int, set[int]]:
    failing: dict[int, set[int]] = {}
    for item in filter(None, os.environ.get("RFEDRAY_CHAOS_FAIL", "").split(";")):
        round_index, _, clients = item.partition(":")
        failing[int(round_index)] = {int(c) for c in clients.split(",") if c}
    return failing


def _patch_executor(module) -> None:
    original = module.LocalExecutor.train
    releases, failing = os.environ.get("RFEDRAY_CHAOS_RELEASES"), _failures()

    def train(self, cohort, theta, round_index, states):
        results = original(self, cohort, theta, round_index, states)
        if failing.get(round_index):
            from rfedray.federated.client import ClientFailure

            results = {cid: ClientFailure("chaos replay: dropout") if cid in failing[round_index] else r
                       for cid, r in results.items()}
        if releases:
            _append(releases, [f"{round_index} {cid}" for cid, r in results.items() if type(r).__name__ == "LocalResult"])
        return results

    module.LocalExecutor.train = train


def _patch_server(module) -> None:
    path = os.environ["RFEDRAY_CHAOS_AGGREGATED"]
    draw, aggregate = module.cohort, module.Server.aggregate
    drawn = []

    def cohort(seed, round_index, n_clients, k):
        drawn.append(round_index)
        return draw(seed, round_index, n_clients, k)

    def combined(self, theta, submissions):
        _append(path, [" ".join(str(v) for v in [drawn[-1], *sorted(submissions)])])
        return aggregate(self, theta, submissions)

    module.cohort, module.Server.aggregate = cohort, combined


TARGETS = {}
if os.environ.get("RFEDRAY_CHAOS_RELEASES") or os.environ.get("RFEDRAY_CHAOS_FAIL"):
    TARGETS["rfedray.federated.executor"] = _patch_executor
if os.environ.get("RFEDRAY_CHAOS_AGGREGATED"):
    TARGETS["rfedray.federated.server"] = _patch_server


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a target module right after it runs (before any other module imports its names)."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def patched_exec(module):
            exec_module(module)
            TARGETS[name](module)

        spec.loader.exec_module = patched_exec
        return spec


if TARGETS:
    sys.meta_path.insert(0, _Finder())
