"""What watches a run from outside the loop: the progress line and the Prometheus endpoint.

Both are round observers (:class:`~rfedray.federated.loop.RoundObserver`): the loop hands them every
round's record and the summary. On the Ray engine the server actor attaches the metrics endpoint
(:func:`attach_metrics`) and the driver the progress line.
"""

from __future__ import annotations

import hashlib
import sys
import time
from contextlib import ExitStack
from typing import Optional

from rfedray.config import Config


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


def config_digest(cfg: Config) -> str:
    """The first 16 hex digits of the SHA-256 of the resolved configuration's YAML."""
    from rfedray.config import to_yaml

    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


class MetricsObserver:
    """Exports round records to Prometheus through :class:`rfedray.metrics.RunMetrics`.

    The run's state (``rfedray_run_info``) is ``running`` from the start, then ``finished`` or
    ``halted`` when the run ends, or ``failed`` when the endpoint closes before that.
    """

    def __init__(self, cfg: Config, run_id: str, sigma: Optional[float]):
        from rfedray import __version__
        from rfedray.metrics import RunMetrics

        self.metrics = RunMetrics(
            run_id=run_id, scheme=cfg.aggregation.scheme, dataset=cfg.data.source, model=cfg.model.name,
            epsilon_target=cfg.privacy.epsilon if cfg.privacy.enabled else None,
            delta=cfg.privacy.delta, sigma=sigma, seeded=cfg.privacy.noise_seed is not None,
            noise_calibrated=cfg.privacy.enabled and cfg.privacy.sigma is None,
            version=__version__, config_digest=config_digest(cfg),
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
        self.metrics.set_state("halted" if summary["halted"] else "finished")

    def close(self) -> None:
        """Stop the endpoint, after ``monitoring.linger_seconds`` so a scraper sees the final values."""
        if self.metrics.state == "running":
            self.metrics.set_state("failed")
        time.sleep(self.linger_seconds)
        self.metrics.close()


def attach_metrics(fed, stack: ExitStack) -> Optional[MetricsObserver]:
    """Start the Prometheus endpoint of ``fed`` if ``monitoring.metrics_port`` is set; ``stack`` closes it.

    Parameters
    ----------
    fed : rfedray.federated.loop.Federation
        Gets the endpoint as an observer, in the process that calls this (on the Ray engine, the
        server actor).
    stack : ExitStack
        Closes the endpoint (after ``monitoring.linger_seconds``) when it unwinds.

    Returns
    -------
    MetricsObserver or None
        The endpoint's observer, None when metrics are off.
    """
    if fed.cfg.monitoring.metrics_port is None:
        return None
    metrics = MetricsObserver(fed.cfg, fed.run_dir.run_id, fed.privacy.sigma)
    stack.callback(metrics.close)
    fed.observers.append(metrics)
    return metrics
