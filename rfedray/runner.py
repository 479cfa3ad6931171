"""Run a configuration on its engine, with progress and metrics attached.

``run.engine: local`` runs the whole federation in this process; ``run.engine: ray`` hands it to the
Ray layer (:func:`actors.driver.run_on_ray`): a server actor runs the same federation loop there and
distributes the clients over client actors, while this process shows the progress line.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from typing import Optional

from rfedray.config import Config
from rfedray.federated.rundir import RunDirectory


class ProgressObserver:
    """Feeds :class:`rfedray.progress.Progress` from round records."""

    def __init__(self, cfg: Config, quiet: bool):
        from rfedray.progress import Progress

        self.progress = Progress(
            cfg.run.rounds, stream=sys.stderr, quiet=quiet or not cfg.monitoring.progress,
            epsilon_target=cfg.privacy.epsilon if cfg.privacy.enabled else None,
        )

    def on_round(self, record: dict) -> None:
        metrics = {k[len("metric_"):]: v for k, v in record.items() if k.startswith("metric_")}
        self.progress.update(record["round"], record["epsilon_spent"], metrics, record["round_seconds"])

    def on_finish(self, summary: dict) -> None:
        eps = summary["epsilon_spent"]
        target = summary["epsilon_target"]
        budget = ", non-private" if eps is None else f", epsilon {eps:.4g}" + ("" if target is None else f" of {target:g}")
        halted = f"; halted: {summary['halt_reason']}" if summary["halted"] else ""
        self.progress.close(f"done: {summary['rounds_completed']} rounds{budget}{halted}")


class MetricsObserver:
    """Exports round records to Prometheus through :class:`rfedray.metrics.RunMetrics`."""

    def __init__(self, cfg: Config, run_id: str, sigma: Optional[float]):
        from rfedray.metrics import RunMetrics

        self.metrics = RunMetrics(
            run_id=run_id, scheme=cfg.aggregation.scheme, dataset=cfg.data.source, model=cfg.model.name,
            epsilon_target=cfg.privacy.epsilon if cfg.privacy.enabled else None,
            delta=cfg.privacy.delta, sigma=sigma, seeded=cfg.privacy.noise_seed is not None,
        )
        self.port = self.metrics.start_server(cfg.monitoring.metrics_port, cfg.monitoring.metrics_host)
        self.linger_seconds = cfg.monitoring.linger_seconds

    def on_round(self, record: dict) -> None:
        metrics = {k[len("metric_"):]: v for k, v in record.items() if k.startswith("metric_")}
        self.metrics.observe_round(
            round=record["round"], epsilon_spent=record["epsilon_spent"],
            cohort_size=record["cohort_size"], answered=record["answered"],
            round_seconds=record["round_seconds"], aggregation_seconds=record["aggregation_seconds"],
            local_train_seconds=record["local_train_seconds"], metrics=metrics,
        )
        if record["failed"]:
            self.metrics.client_failure(record["failed"])
        if record["rejected"]:
            self.metrics.submission_rejected(record["rejected"])

    def on_finish(self, summary: dict) -> None:
        self.metrics.set_halted(bool(summary["halted"]))

    def close(self) -> None:
        """Stop the endpoint, after ``monitoring.linger_seconds`` so a scraper sees the final values."""
        time.sleep(self.linger_seconds)
        self.metrics.close()


def attach_metrics(fed, stack: ExitStack) -> None:
    """Start the Prometheus endpoint of ``fed`` if ``monitoring.metrics_port`` is set; ``stack`` closes it.

    Parameters
    ----------
    fed : rfedray.federated.loop.Federation
        Gets the endpoint as an observer, in the process that calls this (on the Ray engine, the
        server actor).
    stack : ExitStack
        Closes the endpoint (after ``monitoring.linger_seconds``) when it unwinds.
    """
    if fed.cfg.monitoring.metrics_port is not None:
        metrics = MetricsObserver(fed.cfg, fed.run_dir.run_id, fed.privacy.sigma)
        stack.callback(metrics.close)
        fed.observers.append(metrics)


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
