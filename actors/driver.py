"""The Ray engine: connect to (or start) Ray, run the federation on a server actor, train on client actors.

What runs where (``rfedray run --engine ray`` on a Ray cluster it connects to: ``ray.address``,
``RAY_ADDRESS``, or ``ray job submit``):

* the driver process, :func:`run_on_ray`: connects to Ray, starts the server actor on its own node,
  shows the progress line and the server's warnings, returns the summary;
* the server actor (:mod:`actors.server_actor`), on the driver's node: runs
  :meth:`rfedray.federated.loop.Federation.run`, the loop the local engine runs, with the
  :class:`~actors.engine.RayExecutor` of :func:`~actors.engine.ray_executor`; it owns the run directory (on the driver's disk),
  the Prometheus endpoint and the actors below, and ``--resume`` is the local engine's resume
  (checkpoint, plus ``budget.json`` which may be ahead of it);
* client actors (:mod:`actors.client_actor`) host sticky blocks of clients and build their data
  themselves;
* the accountant actor (:mod:`actors.accountant_actor`) holds every client's budget, is pinned to
  the server's node and persists ``budget.json`` before each round trains.

When no cluster is given, the driver starts a Ray instance of its own: one machine. It then runs the
server's part itself, ledger included (:func:`actors.server_actor.serve`): no server or accountant
actor. The clients are on client actors in both layouts, so the process that runs the server's part
never holds a client's records (an honest-but-curious server must not). It shuts that instance down
at the end.
"""

from __future__ import annotations

import logging
from typing import Sequence

import ray

from actors.server_actor import serve, start_server
from actors.session import RaySession, check_ray_config, user_code_env
from rfedray.errors import RfedrayError, RunFailure
from rfedray.federated.loop import Federation, RoundObserver
from rfedray.federated.rundir import RunDirectory

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


def run_on_ray(fed: Federation, observers: Sequence[RoundObserver], *, resume: bool = False) -> dict:
    """Run (or resume) the federation ``fed``; relay its progress to ``observers``.

    Runs in the driver process. On a Ray cluster it connects to, the federation runs in a server
    actor on this node, which prepares it again from ``fed.cfg``; on a Ray instance it starts itself
    (one machine), it runs ``fed`` here, in this process (see the module docstring).

    Parameters
    ----------
    fed : Federation
        Prepared in this process (its inputs checked before Ray starts).
    observers : sequence of RoundObserver
        Get every round record (from a server actor: run-level values only) and the summary, here.
    resume : bool
        Continue ``fed.run_dir`` from its checkpoint.

    Returns
    -------
    dict
        The summary, also in ``summary.json`` of the run directory.

    Raises
    ------
    RfedrayError
        When Ray cannot be reached, the run fails (the server's error), or the server actor dies.
    """
    check_ray_config(fed.cfg)
    session = RaySession.open(fed.cfg.ray.address)
    try:
        if session.one_machine:
            fed.observers.extend(observers)
            return serve(fed, session, resume=resume)
        given = fed.given
        server = start_server(fed.cfg, fed.run_dir, given,
                              user_code_env(fed.cfg, given.objects() if given is not None else ()))
        try:
            return _follow(server, server.run.remote(resume), observers, fed.run_dir)
        finally:
            ray.kill(server, no_restart=True)
    finally:
        session.close()
