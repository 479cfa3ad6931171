"""The chaos test's side channel: every client training that returned a submission, appended to a file.

On ``PYTHONPATH`` only for the chaos test's runs, with ``RFEDRAY_CHAOS_RELEASES=FILE``: when a
process (the driver, or a Ray client actor) imports :mod:`rfedray.federated.executor`, its
``LocalExecutor.train`` (which both engines use to train a cohort) is wrapped so that each client
that answered appends ``round client`` to FILE before the submissions leave the process. The count
is the test's own, independent of everything the run writes.
"""

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "rfedray.federated.executor"


def _patch(module) -> None:
    original = module.LocalExecutor.train
    path = os.environ["RFEDRAY_CHAOS_RELEASES"]

    def train(self, cohort, theta, round_index, states):
        results = original(self, cohort, theta, round_index, states)
        released = [cid for cid, r in results.items() if type(r).__name__ == "LocalResult"]
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, "".join(f"{round_index} {cid}\n" for cid in released).encode())
        finally:
            os.close(fd)
        return results

    module.LocalExecutor.train = train


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = patched_exec
        return spec


if os.environ.get("RFEDRAY_CHAOS_RELEASES"):
    import importlib.util

    sys.meta_path.insert(0, _Finder())
