"""The federation server of a Ray run: one actor that owns the run, on the driver's node.

What runs where (``rfedray run`` with ``run.engine: ray``):

* the driver process (:func:`actors.driver.run_on_ray`) connects to Ray, starts the server actor,
  relays its round records and warnings to the progress line and the log, and returns its summary;
* the :class:`ServerActor`, pinned to the driver's node so that the run directory is on the
  driver's disk, builds the :class:`~rfedray.federated.loop.Federation` from the configuration and
  runs :meth:`~rfedray.federated.loop.Federation.run` with the Ray executor
  (:func:`actors.engine.ray_executor`): cohort draw, write-ahead charge, theta_t put once per round,
  concurrent client calls within ``ray.round_timeout_s``, aggregation, evaluation,
  ``metrics.jsonl``, checkpoints and ``summary.json``. It serves the run's Prometheus endpoint
  (``monitoring.metrics_port``, with every client actor's device), so the metrics come from one
  place and do not depend on the driver;
* the client actors and the accountant actor are created by the server and owned by it: they end
  with it. ``RUN_DIR/placement.json`` records where the server and the client actors started.

When the driver starts a Ray instance itself, the run is on one machine: the driver runs
:func:`serve` in its own process, with the ledger there too (no server or accountant actor: two
processes and their memory fewer); the clients train in client actors as on a cluster, so the
server's process holds no client's records in either layout (:mod:`actors.engine`).

A server that dies loses nothing that ``rfedray run --resume RUN_DIR`` needs: the checkpoint and the
write-ahead ``budget.json`` are on the driver's disk.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack, contextmanager
from typing import Iterator, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.engine import ray_executor
from actors.session import RaySession
from rfedray.config import Config
from rfedray.errors import RfedrayError
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import GivenTask
from rfedray.observers import attach_metrics
from rfedray.threads import use_threads

SERVER_NAMESPACE = "rfedray"
"""Ray namespace of the server actors, each named ``server-<run id>`` (``ray list actors`` shows them)."""

RELAYED_LOGGERS = ("rfedray", "actors")
"""Loggers whose warnings the server keeps for the driver to log."""


@contextmanager
def user_errors_as_rfedray_errors() -> Iterator[None]:
    """Re-raise rfedray's user errors as plain :class:`RfedrayError` with the same message and exit status.

    Ray wraps an actor's exception in a class derived from the exception's own, and cannot build
    one for the subclasses (``ConfigError``, ``PrivacyParameterError``) whose constructors take
    three arguments; a plain RfedrayError always reaches the driver intact.
    """
    try:
        yield
    except RfedrayError as exc:
        plain = RfedrayError(str(exc))
        plain.exit_code = exc.exit_code
        raise plain from None


class WarningRelay(logging.Handler):
    """Keeps ``(logger name, level, message)`` of every warning for the driver to log again."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.name, record.levelno, record.getMessage()))


class PlacementRecord:
    """Writes ``RUN_DIR/placement.json`` (where the server and the client actors run) with the first round.

    A run that fails before its first round leaves the run directory as it was.
    """

    def __init__(self, run_dir: RunDirectory):
        self.run_dir, self.placement, self.written = run_dir, {}, False

    def on_round(self, record: dict) -> None:
        if not self.written:
            self.run_dir.write_json("placement.json", self.placement)
            self.written = True

    def on_finish(self, summary: dict) -> None:
        """Nothing to write at the end."""


def serve(fed: Federation, session: RaySession, *, resume: bool, runtime_env: Optional[dict] = None) -> dict:
    """Run ``fed`` in this process on the Ray executor, with its metrics endpoint; return the summary.

    Parameters
    ----------
    fed : Federation
        Prepared in this process; its observers get every round record and the summary.
    session : RaySession
        This process's connection to Ray; on one machine the ledger stays in this process
        (:class:`actors.engine.RayExecutor`), else the ledger is an accountant actor.
    resume : bool
    runtime_env : dict, optional
        Of the client actors (by default :func:`~actors.session.user_code_env` of ``fed``).

    This process takes the threads the local engine's would (:mod:`rfedray.threads`): its
    aggregation and evaluation are of the same small kernels, and the 2 BLAS threads it had by
    default spun on a busy machine (synthetic PCA's oracle at n = 500 took 58 s of a 94 s start-up).
    """
    cfg = fed.cfg
    threads = use_threads(fed.threads())
    with ExitStack() as stack:
        record = PlacementRecord(fed.run_dir)
        fed.observers.insert(0, record)
        metrics = attach_metrics(fed, stack)
        executor = ray_executor(fed, runtime_env, session)
        stack.callback(executor.close)
        record.placement = {
            "server": {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "threads": threads,
                       "accountant": "in this process" if session.one_machine else "actor"},
            "client_actors": executor.describe(),
        }
        if metrics is not None:
            metrics.metrics.set_client_actors(record.placement["client_actors"])
        return fed.run(executor, resume=resume)


class ServerActor:
    """Runs one federation in its own process; the driver polls it for progress.

    The actor is threaded (``max_concurrency=2``): :meth:`updates_since` answers while :meth:`run`
    works.

    It works in the driver's working directory (on the same node), so the relative paths of the
    configuration (``run.output_dir``, data files) mean what they mean to the driver.

    Parameters
    ----------
    cfg : Config
    run_dir : str
        The run directory, on this (the driver's) node.
    writer_token : str
        The token of the driver's lock on it (see :class:`rfedray.federated.rundir.RunLock`).
    cwd : str
        The driver's working directory.
    given : GivenTask, optional
        The user's model or dataset objects.
    runtime_env : dict, optional
        This actor's runtime environment (the user's code), for the client actors too.
    """

    def __init__(self, cfg: Config, run_dir: str, writer_token: str, cwd: str, given: Optional[GivenTask] = None,
                 runtime_env: Optional[dict] = None):
        os.chdir(cwd)
        self.cfg, self.run_dir = cfg, RunDirectory(run_dir, writer_token)
        self.given, self.runtime_env = given, runtime_env
        self.records: list[dict] = []
        self.relay = WarningRelay()
        for name in RELAYED_LOGGERS:
            logging.getLogger(name).addHandler(self.relay)

    def run(self, resume: bool) -> dict:
        """Build the federation, start its actors and metrics endpoint, run it (:func:`serve`).

        Raises
        ------
        RfedrayError
            A user error of the run, with its message (as a plain RfedrayError, which always
            reaches the driver intact).
        """
        with user_errors_as_rfedray_errors():
            fed = Federation.prepare(self.cfg, self.run_dir, [self], self.given)
            return serve(fed, RaySession(started=False), resume=resume, runtime_env=self.runtime_env)

    def on_round(self, record: dict) -> None:
        """Keep the round's run-level values for the driver."""
        self.records.append({k: v for k, v in record.items() if not isinstance(v, list)})

    def on_finish(self, summary: dict) -> None:
        """Nothing to keep: :meth:`run` returns the summary."""

    def updates_since(self, rounds: int, warnings: int) -> tuple[list[dict], list[tuple[str, int, str]]]:
        """The round records and warnings after the first ``rounds`` and ``warnings`` already seen."""
        return self.records[rounds:], self.relay.lines[warnings:]


def start_server(cfg: Config, run_dir: RunDirectory, given: Optional[GivenTask] = None,
                 runtime_env: Optional[dict] = None):
    """The server actor of ``run_dir``, pinned to this (the driver's) node, never restarted.

    ``given`` (the user's objects) and ``runtime_env`` (the user's code,
    :func:`actors.session.user_code_env`) go to the server and from it to the client actors.
    """
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(ServerActor).options(
        name=f"server-{run_dir.run_id}", namespace=SERVER_NAMESPACE, num_cpus=0, max_concurrency=2,
        max_restarts=0, scheduling_strategy=here, runtime_env=runtime_env,
    )
    return actor_cls.remote(cfg, str(run_dir.path), run_dir.writer_token, os.getcwd(), given, runtime_env)
