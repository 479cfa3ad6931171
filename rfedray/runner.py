"""Run a configuration on its engine, with progress and metrics attached.

``run.engine: local`` runs the whole federation in this process; ``run.engine: ray`` hands it to the
Ray layer (:func:`actors.driver.run_on_ray`): the same federation loop distributes the clients over
client actors (on a cluster, in a server actor, while this process shows the progress line).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import TYPE_CHECKING, Optional, Sequence

from rfedray.config import Config
from rfedray.errors import RfedrayError
from rfedray.federated.rundir import RunDirectory, RunDirectoryWriteError
from rfedray.federated.storage import describe_holder
from rfedray.observers import ProgressObserver, attach_metrics

if TYPE_CHECKING:
    from rfedray.federated.setup import GivenTask

log = logging.getLogger(__name__)


def run(cfg: Config, run_dir: RunDirectory, *, quiet: bool = False, resume: bool = False,
        given: Optional[GivenTask] = None) -> dict:
    """Run ``cfg`` into ``run_dir`` on the configured engine, write the plots, return the summary.

    This process (the driver) holds the run directory's lock for the whole run: a second
    ``rfedray run --resume`` of the same directory is refused, naming this one. The run's
    writers (here, or the Ray server and accountant actors) write under the lock's token.
    ``given`` holds the user's model or dataset objects when the run was started from Python
    (:func:`rfedray.api.run`).

    Raises
    ------
    RfedrayError
        A user error, a busy run directory, or a write that failed (exit status 1).
    """
    from rfedray.federated.loop import Federation
    from rfedray.progress import log_startup
    from rfedray.report import write_plots

    log_startup("command line read (imports)")

    with run_dir.lock() as lock:
        # Refuse bad data, privacy settings and run directories here, before anything is written
        # (and, on the Ray engine, before Ray starts: a server actor on a cluster builds it again).
        fed = Federation.prepare(cfg, run_dir, given=given)
        if resume:
            fed.check_resume()
        if lock.previous_holder_died():
            log.warning("%s: the previous rfedray process (%s) ended without releasing the run directory; continuing "
                        "from its checkpoint and budget", run_dir.path, describe_holder(lock.previous))
        run_dir.announce(lock, "rfedray run --resume" if resume else "rfedray run")
        log_startup("federation prepared (data sizes, privacy calibration)")
        observers = [ProgressObserver(cfg, quiet)]
        if cfg.run.engine == "ray":
            from actors.driver import run_on_ray

            summary = run_on_ray(fed, observers, resume=resume)
        else:
            fed.observers.extend(observers)
            summary = run_local(fed, resume=resume)
    try:
        write_plots(RunDirectory(run_dir.path))
    except (OSError, RfedrayError) as exc:
        log.warning("the plots of %s were not written (%s); the run is complete", run_dir.path,
                    getattr(exc, "strerror", None) or exc)
    return summary


def run_discarding_refused(cfg: Config, run_dir: RunDirectory, *, quiet: bool = False, resume: bool = False,
                           given: Optional[GivenTask] = None) -> dict:
    """:func:`run`, removing a new run directory that a run refused before its first checkpoint left
    (nothing was charged then)."""
    try:
        return run(cfg, run_dir, quiet=quiet, resume=resume, given=given)
    except RfedrayError as exc:
        if not resume and not run_dir.exists("checkpoint.pt"):
            run_dir.remove_all()
            if hasattr(exc, "problem"):
                raise RunDirectoryWriteError(f"{exc.problem}; nothing was charged and the run directory is removed: "
                                             f"{exc.remedy} and run the command again") from None
        raise


def resume_config(run_dir: RunDirectory, overrides: Sequence[str]) -> Config:
    """The configuration of a run directory (its ``config.yaml``) with ``key=value`` overrides.

    Raises
    ------
    RfedrayError
        When ``run_dir`` has no ``config.yaml``.
    """
    from rfedray.config import load_config_text

    if not run_dir.is_file("config.yaml"):
        raise RfedrayError(f"--resume {run_dir.path}: not a run directory (no config.yaml there)")
    return load_config_text(run_dir.read_bytes("config.yaml"), str(run_dir.config), list(overrides))


def run_local(fed, *, resume: bool = False) -> dict:
    """The whole federation ``fed`` in this process, metrics endpoint included; return the summary.

    The process's torch and BLAS threads are chosen from the work (:mod:`rfedray.threads`).
    """
    from rfedray.threads import use_threads

    use_threads(fed.threads())
    with ExitStack() as stack:
        attach_metrics(fed, stack)
        executor = fed.local_executor()
        stack.callback(executor.close)
        return fed.run(executor, resume=resume)
