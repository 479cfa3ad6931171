"""Run a configuration on its engine, with progress and metrics attached.

``run.engine: local`` runs the whole federation in this process; ``run.engine: ray`` hands it to the
Ray layer (:func:`actors.driver.run_on_ray`): a server actor runs the same federation loop there and
distributes the clients over client actors, while this process shows the progress line.
"""

from __future__ import annotations

from contextlib import ExitStack

from rfedray.config import Config
from rfedray.federated.rundir import RunDirectory
from rfedray.observers import ProgressObserver, attach_metrics


def run(cfg: Config, run_dir: RunDirectory, *, quiet: bool = False, resume: bool = False) -> dict:
    """Run ``cfg`` into ``run_dir`` on the configured engine, write the plots, return the summary."""
    from rfedray.report import write_plots

    observers = [ProgressObserver(cfg, quiet)]
    if cfg.run.engine == "ray":
        from actors.driver import run_on_ray
        from rfedray.federated.loop import Federation

        # Refuse bad data and privacy settings here, before Ray starts (the server builds the
        # federation again on its side).
        fed = Federation.prepare(cfg, run_dir)
        if resume:
            fed.check_resume()
        summary = run_on_ray(cfg, run_dir, observers, resume=resume)
    else:
        summary = run_local(cfg, run_dir, observers, resume=resume)
    write_plots(run_dir.path)
    return summary


def run_local(cfg: Config, run_dir: RunDirectory, observers: list, *, resume: bool = False) -> dict:
    """The whole federation in this process, metrics endpoint included; return the summary.

    The process's torch and BLAS threads are chosen from the work (:mod:`rfedray.threads`).
    """
    from rfedray.federated.loop import Federation
    from rfedray.threads import available_cpus, choose_threads, use_threads

    fed = Federation.prepare(cfg, run_dir, observers)
    use_threads(choose_threads(cfg.federation.batch_size, fed.dataset.info["record_shape"], available_cpus(), cfg.run.threads))
    with ExitStack() as stack:
        attach_metrics(fed, stack)
        executor = fed.local_executor()
        stack.callback(executor.close)
        return fed.run(executor, resume=resume)
