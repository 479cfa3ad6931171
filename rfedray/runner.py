"""Run a configuration on its engine, with progress and metrics attached.

``run.engine: local`` runs the whole federation in this process; ``run.engine: ray`` hands it to the
Ray layer (:func:`actors.driver.run_on_ray`): a server actor runs the same federation loop there and
distributes the clients over client actors, while this process shows the progress line.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from rfedray.config import Config
from rfedray.errors import RfedrayError
from rfedray.federated.rundir import RunDirectory
from rfedray.observers import ProgressObserver, attach_metrics

if TYPE_CHECKING:
    from rfedray.federated.setup import GivenTask


def run(cfg: Config, run_dir: RunDirectory, *, quiet: bool = False, resume: bool = False,
        given: Optional[GivenTask] = None) -> dict:
    """Run ``cfg`` into ``run_dir`` on the configured engine, write the plots, return the summary.

    ``given`` holds the user's model or dataset objects when the run was started from Python
    (:func:`rfedray.api.run`).
    """
    from rfedray.report import write_plots

    observers = [ProgressObserver(cfg, quiet)]
    if cfg.run.engine == "ray":
        from actors.driver import run_on_ray
        from rfedray.federated.loop import Federation

        # Refuse bad data and privacy settings here, before Ray starts (the server builds the
        # federation again on its side).
        fed = Federation.prepare(cfg, run_dir, given=given)
        if resume:
            fed.check_resume()
        summary = run_on_ray(cfg, run_dir, observers, resume=resume, given=given)
    else:
        summary = run_local(cfg, run_dir, observers, resume=resume, given=given)
    write_plots(run_dir.path)
    return summary


def run_discarding_refused(cfg: Config, run_dir: RunDirectory, *, quiet: bool = False, resume: bool = False,
                           given: Optional[GivenTask] = None) -> dict:
    """:func:`run`, removing a new run directory that a refused run left without a charge or a round."""
    try:
        return run(cfg, run_dir, quiet=quiet, resume=resume, given=given)
    except RfedrayError:
        if not resume and not run_dir.metrics.exists() and not run_dir.budget.exists():
            shutil.rmtree(run_dir.path, ignore_errors=True)
        raise


def resume_config(run_dir: Path, overrides: Sequence[str]) -> Config:
    """The configuration of a run directory (its ``config.yaml``) with ``key=value`` overrides.

    Raises
    ------
    RfedrayError
        When ``run_dir`` has no ``config.yaml``.
    """
    from rfedray.config import load_config

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise RfedrayError(f"--resume {run_dir}: not a run directory (no config.yaml there)")
    return load_config(saved, list(overrides))


def run_local(cfg: Config, run_dir: RunDirectory, observers: list, *, resume: bool = False,
              given: Optional[GivenTask] = None) -> dict:
    """The whole federation in this process, metrics endpoint included; return the summary.

    The process's torch and BLAS threads are chosen from the work (:mod:`rfedray.threads`).
    """
    from rfedray.federated.loop import Federation
    from rfedray.threads import available_cpus, choose_threads, use_threads

    fed = Federation.prepare(cfg, run_dir, observers, given)
    use_threads(choose_threads(cfg.federation.batch_size, fed.dataset.info.get("record_shape", ()), available_cpus(),
                               cfg.run.threads))
    with ExitStack() as stack:
        attach_metrics(fed, stack)
        executor = fed.local_executor()
        stack.callback(executor.close)
        return fed.run(executor, resume=resume)
