"""The Ray engine: connect to (or start) Ray, run the federation on a server actor, train on client actors.

What runs where (``rfedray run --engine ray``):

* the driver process, :func:`run_on_ray`: connects to Ray (or starts it), starts the server actor on
  its own node, shows the progress line and the server's warnings, returns the summary and shuts
  Ray down if it started it;
* the server actor (:mod:`actors.server_actor`), on the driver's node: runs
  :meth:`rfedray.federated.loop.Federation.run`, the loop the local engine runs, with the
  :class:`~actors.engine.RayExecutor` of :func:`~actors.engine.ray_executor`; it owns the run directory (on the driver's disk),
  the Prometheus endpoint and the actors below, and ``--resume`` is the local engine's resume
  (checkpoint, plus ``budget.json`` which may be ahead of it);
* client actors (:mod:`actors.client_actor`) host sticky blocks of clients and build their data
  themselves;
* the accountant actor (:mod:`actors.accountant_actor`) holds every client's budget, is pinned to
  the server's node and persists ``budget.json`` before each round trains.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import ray

from actors.server_actor import start_server
from actors.session import RaySession, check_ray_config, user_code_env
from rfedray.config import Config
from rfedray.errors import RfedrayError, RunFailure
from rfedray.federated.loop import RoundObserver
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import GivenTask

POLL_INTERVAL_S = 0.5
"""How often the driver asks the server actor for new round records and warnings."""


def _follow(server, finished: ray.ObjectRef, observers: Sequence[RoundObserver], run_dir: RunDirectory) -> dict:
    """Relay the server's round records and warnings until its run ends; return its summary.

    Raises
    ------
    RfedrayError
        The run's own error as the server raised it, or one line saying that the server actor died
        and how to resume.
    """
    rounds = warnings = 0
    while True:
        ended = bool(ray.wait([finished], timeout=POLL_INTERVAL_S)[0])
        try:
            records, lines = ray.get(server.updates_since.remote(rounds, warnings))
        except ray.exceptions.RayActorError:
            break  # the server died: ray.get(finished) says how
        for name, level, message in lines:
            logging.getLogger(name).log(level, "%s", message)
        for record in records:
            for obs in observers:
                obs.on_round(record)
        rounds, warnings = rounds + len(records), warnings + len(lines)
        if ended:
            break
    try:
        summary = ray.get(finished)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RfedrayError):
            raise exc.cause from None
        raise  # a bug: keep the server's traceback
    except ray.exceptions.RayActorError as exc:
        reason = str(exc).strip().splitlines()[0]
        raise RunFailure(
            f"the federation server actor died ({type(exc).__name__}: {reason}); the run directory keeps the last "
            f"checkpoint and every charge: continue with rfedray run --resume {run_dir.path}"
        ) from None
    for obs in observers:
        obs.on_finish(summary)
    return summary


def run_on_ray(cfg: Config, run_dir: RunDirectory, observers: Sequence[RoundObserver], *, resume: bool = False,
               given: Optional[GivenTask] = None) -> dict:
    """Run (or resume) the federation of ``cfg`` on a server actor; relay its progress to ``observers``.

    Runs in the driver process; the federation runs in the server actor, on this node (see the
    module docstring).

    Parameters
    ----------
    cfg : Config
    run_dir : RunDirectory
        Where the server writes the run (on this node's disk).
    observers : sequence of RoundObserver
        Get every round record (run-level values only) and the summary, here in the driver.
    resume : bool
        Continue ``run_dir`` from its checkpoint.
    given : GivenTask, optional
        The user's model or dataset objects, sent to the server and client actors.

    Returns
    -------
    dict
        The summary, also in ``run_dir/summary.json``.

    Raises
    ------
    RfedrayError
        When Ray cannot be reached, the run fails (the server's error), or the server actor dies.
    """
    check_ray_config(cfg)
    session = RaySession.open(cfg.ray.address)
    try:
        server = start_server(cfg, run_dir, given, user_code_env(cfg, given.objects() if given is not None else ()))
        try:
            return _follow(server, server.run.remote(resume), observers, run_dir)
        finally:
            ray.kill(server, no_restart=True)
    finally:
        session.close()
