"""Prometheus metrics of one run, exported from one place: the server (driver) process.

A :class:`RunMetrics` owns its own :class:`prometheus_client.CollectorRegistry`, so several runs in
one process (tests, notebooks, a benchmark sweep) do not clash over metric names, and its own HTTP
endpoint (``monitoring.metrics_host``/``monitoring.metrics_port``) that Prometheus scrapes. Why
``prometheus_client`` and not ``ray.util.metrics`` is explained in ``monitoring/README.md``.

Every series carries the four labels ``run_id``, ``scheme``, ``dataset`` and ``model``, fixed when
the run starts: no label value depends on the data, and no metric is broken down by client
(failures and local-training times are aggregated over the cohort), so the endpoint reveals nothing
about any one client beyond what the released model already does. Two info gauges (value 1) carry
more labels, about the software and the machines, never the data: ``rfedray_run_info`` (version,
configuration digest, state) and ``rfedray_client_actor_device`` (one series per client actor of the
Ray engine: actor slot, node, torch device, GPU ids).

The names are listed in :data:`METRIC_NAMES` (the forms that appear in the exposition, including
the ``_total``, ``_bucket``, ``_count``, ``_sum`` and ``_created`` series), which the alert rules
and the Grafana dashboard under ``monitoring/`` are checked against.
"""

from __future__ import annotations

import errno
import math
import threading
import time
from typing import Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from rfedray.errors import ConfigError

LABELS = ("run_id", "scheme", "dataset", "model")

ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
AGGREGATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Keys of ``observe_round(metrics=...)`` that are exported, and the gauge each one sets. Other keys
# are ignored: the endpoint's set of series must not grow with whatever a model chooses to report.
ROUND_METRIC_GAUGES = {
    "loss": "rfedray_training_loss",
    "accuracy": "rfedray_test_accuracy",
    "gap": "rfedray_optimality_gap",
    "distance": "rfedray_distance_to_optimum",
    "oracle_loss": "rfedray_oracle_training_loss",
    "oracle_gap": "rfedray_oracle_optimality_gap",
    "oracle_distance": "rfedray_oracle_distance_to_optimum",
}

_GAUGES = {
    "rfedray_current_round": "Rounds completed so far, counting those before a resume (last round index + 1).",
    "rfedray_epsilon_spent": "Epsilon spent so far (maximum over the clients' transcripts), at rfedray_delta.",
    "rfedray_epsilon_target": "Target epsilon of the run (absent when the run has no target).",
    "rfedray_delta": "Delta of the (epsilon, delta) guarantee.",
    "rfedray_noise_sigma": "Absolute standard deviation of the Gaussian noise of a private step (absent when not private).",
    "rfedray_cohort_size": "Clients selected in the last round.",
    "rfedray_clients_answered": "Clients of the last round's cohort whose submission arrived.",
    "rfedray_halted": "1 when the run has halted (e.g. the privacy budget reached its target), else 0.",
    "rfedray_last_round_completed_timestamp_seconds": "Unix time at which the last round completed.",
    "rfedray_run_start_timestamp_seconds": "Unix time at which the run's metrics were created.",
    "rfedray_not_for_production": "1 when the privacy noise is seeded (reproducible, so not private in production), else 0.",
    "rfedray_noise_calibrated": (
        "1 when sigma was calibrated so that the run's last round reaches the target epsilon, 0 when it was given."
    ),
    "rfedray_training_loss": "Loss of the global model after the last evaluated round.",
    "rfedray_test_accuracy": "Test accuracy of the global model after the last evaluated round.",
    "rfedray_optimality_gap": "Optimality gap F(theta) - F(theta*) of the global model after the last evaluated round.",
    "rfedray_distance_to_optimum": "Distance of the global model to the optimum after the last evaluated round.",
    "rfedray_oracle_training_loss": "Loss of the global model on the pooled training records (a simulation oracle, "
                                    "not covered by the privacy guarantee; only with monitoring.export_oracle_metrics).",
    "rfedray_oracle_optimality_gap": "Optimality gap on the pooled training records (a simulation oracle, not covered "
                                     "by the privacy guarantee; only with monitoring.export_oracle_metrics).",
    "rfedray_oracle_distance_to_optimum": "Distance to the optimum of the pooled training records (a simulation oracle, "
                                          "not covered by the privacy guarantee; only with monitoring.export_oracle_metrics).",
}
_COUNTERS = {
    "rfedray_rounds_completed": "Rounds completed.",
    "rfedray_clients_selected": "Client selections, summed over the rounds (cohort sizes).",
    "rfedray_client_failures": "Selected clients that failed to answer (crash, node loss, timeout).",
    "rfedray_submissions_rejected": "Submissions the server rejected (not finite, wrong shape, ...).",
}
_HISTOGRAMS = {
    "rfedray_round_duration_seconds": ("Wall time of a round, selection to new global model.", ROUND_BUCKETS),
    "rfedray_aggregation_duration_seconds": ("Wall time of the server's aggregation of a round.", AGGREGATION_BUCKETS),
    "rfedray_local_train_duration_seconds": (
        "Wall time of one client's local training in a round (one observation per answering client).",
        ROUND_BUCKETS,
    ),
}

RUN_STATES = ("running", "finished", "halted", "failed")
"""Values of the ``state`` label of ``rfedray_run_info``: running until the run ends, then how it ended."""

_INFO_GAUGES = {
    "rfedray_run_info": (
        "1 for the run's software version, configuration digest and state (running, finished, halted, failed).",
        ("version", "config_digest", "state"),
    ),
    "rfedray_client_actor_device": (
        "1 for each client actor of the Ray engine: its slot, node, torch device and Ray GPU ids.",
        ("actor", "node_id", "device", "gpu_ids"),
    ),
}

INFO_LABELS: dict[str, tuple[str, ...]] = {name: extra for name, (_, extra) in _INFO_GAUGES.items()}
"""The labels each info gauge carries besides :data:`LABELS`."""

METRIC_NAMES: frozenset[str] = frozenset(
    set(_GAUGES) | set(_INFO_GAUGES)
    | {f"{name}{suffix}" for name in _COUNTERS for suffix in ("_total", "_created")}
    | {f"{name}{suffix}" for name in _HISTOGRAMS for suffix in ("_bucket", "_count", "_sum", "_created")}
)
"""Every metric name the endpoint can expose, in the form that appears in the exposition."""


def _check_label(field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}={value!r}: must be a non-empty string")
    return value


def _check_nonnegative(field: str, value: float, *, allow_inf: bool = False) -> float:
    value = float(value)
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        allowed = "a number >= 0 (inf allowed)" if allow_inf else "a finite number >= 0"
        raise ValueError(f"{field}={value!r}: must be {allowed}")
    return value


def _check_count(field: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}={value!r}: must be an integer >= 0")
    return value


class RunMetrics:
    """The Prometheus metrics of one run, in a registry of their own.

    Parameters
    ----------
    run_id, scheme, dataset, model : str
        Label values of every series (the run directory's id, ``aggregation.scheme``,
        ``data.source`` and ``model.name``).
    epsilon_target : float or None
        Target epsilon, > 0; None when the run has no target (sigma given, or not private).
    delta : float
        Delta of the guarantee, in (0, 1).
    sigma : float or None
        Absolute noise standard deviation of a private step, > 0; None when not private.
    seeded : bool
        Whether the privacy noise comes from a fixed seed; exported as
        ``rfedray_not_for_production`` (1 when seeded).
    noise_calibrated : bool
        Whether sigma was calibrated to reach the target at the run's last round
        (``rfedray_noise_calibrated``): such a run ends near its target by design.
    version, config_digest : str
        Labels of ``rfedray_run_info``.

    Raises
    ------
    ValueError
        When a value is outside its allowed range; the message names the argument.
    """

    def __init__(
        self,
        *,
        run_id: str,
        scheme: str,
        dataset: str,
        model: str,
        epsilon_target: Optional[float],
        delta: float,
        sigma: Optional[float],
        seeded: bool,
        noise_calibrated: bool = False,
        version: str = "unknown",
        config_digest: str = "unknown",
    ):
        values = {name: _check_label(name, value) for name, value in zip(LABELS, (run_id, scheme, dataset, model))}
        self.info = {"version": _check_label("version", version), "config_digest": _check_label("config_digest", config_digest)}
        if epsilon_target is not None and not (math.isfinite(epsilon_target) and epsilon_target > 0):
            raise ValueError(f"epsilon_target={epsilon_target!r}: must be None or a finite number > 0")
        if not (0.0 < delta < 1.0):
            raise ValueError(f"delta={delta!r}: must be in the open interval (0, 1)")
        if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma={sigma!r}: must be None or a finite number > 0")
        for name, flag in (("seeded", seeded), ("noise_calibrated", noise_calibrated)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r}: must be True or False")

        self.registry = CollectorRegistry(auto_describe=True)
        self.labels: dict[str, str] = values
        self._lock = threading.Lock()
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._families: dict[str, Gauge | Counter | Histogram] = {}
        for name, doc in _GAUGES.items():
            self._families[name] = Gauge(name, doc, LABELS, registry=self.registry)
        for name, doc in _COUNTERS.items():
            self._families[name] = Counter(name, doc, LABELS, registry=self.registry)
        for name, (doc, buckets) in _HISTOGRAMS.items():
            self._families[name] = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
        for name, (doc, extra) in _INFO_GAUGES.items():
            self._families[name] = Gauge(name, doc, LABELS + extra, registry=self.registry)
        self.state: Optional[str] = None
        # A labelled series is exported once its child exists: counters and histograms start at 0
        # (rates need the zero), gauges appear when they have a value (a dashboard shows "no
        # data" for a round not yet completed rather than a misleading 0).
        for name in (*_COUNTERS, *_HISTOGRAMS):
            self._child(name)
        if epsilon_target is not None:
            self._child("rfedray_epsilon_target").set(epsilon_target)
        if sigma is not None:
            self._child("rfedray_noise_sigma").set(sigma)
        self._child("rfedray_delta").set(delta)
        self._child("rfedray_halted").set(0)
        self._child("rfedray_not_for_production").set(1 if seeded else 0)
        self._child("rfedray_noise_calibrated").set(1 if noise_calibrated else 0)
        self._child("rfedray_run_start_timestamp_seconds").set(time.time())
        self.set_state("running")

    def _child(self, name: str):
        """The series of metric ``name`` carrying this run's labels (created on first use)."""
        return self._families[name].labels(**self.labels)

    def start_server(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` from a daemon thread.

        Parameters
        ----------
        port : int
            Port in [0, 65535]; 0 lets the system choose a free one.
        host : str
            Address to bind: ``127.0.0.1`` (default) for this machine only, ``0.0.0.0`` for a
            Prometheus running elsewhere (e.g. on a cluster's head node).

        Returns
        -------
        int
            The bound port.

        Raises
        ------
        ValueError
            For a port outside [0, 65535], an empty host, or a second call.
        rfedray.config.ConfigError
            When the port is already in use (the message names ``monitoring.metrics_port``).
        """
        if isinstance(port, bool) or not isinstance(port, int) or not (0 <= port <= 65535):
            raise ValueError(f"monitoring.metrics_port={port!r}: must be a port in [0, 65535] (0 picks a free one)")
        if not isinstance(host, str) or not host:
            raise ValueError(f"monitoring.metrics_host={host!r}: must be a non-empty host name or address")
        with self._lock:
            if self._server is not None:
                raise ValueError(f"monitoring.metrics_port: the metrics server already listens on port {self.port}")
            try:
                self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        "monitoring.metrics_port", port,
                        f"port {port} on {host} is already in use; choose a free port, or 0 to let the system pick one",
                    ) from None
                raise ConfigError(
                    "monitoring.metrics_host", host, f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
                ) from None
            return self.port

    @property
    def port(self) -> Optional[int]:
        """The port the endpoint listens on, or None before :meth:`start_server`."""
        return None if self._server is None else int(self._server.server_port)

    def observe_round(
        self,
        *,
        round: int,
        epsilon_spent: Optional[float],
        cohort_size: int,
        answered: int,
        round_seconds: float,
        aggregation_seconds: float,
        local_train_seconds: Sequence[float],
        metrics: Mapping[str, float],
    ) -> None:
        """Record one completed round.

        Parameters
        ----------
        round : int
            Index of the round just completed, >= 0, as in the run directory's ``metrics.jsonl``;
            ``rfedray_current_round`` is set to ``round + 1``.
        epsilon_spent : float or None
            Epsilon spent so far (maximum over the clients' transcripts), >= 0 (inf allowed); None
            for a non-private run (the series is then absent).
        cohort_size : int
            Clients selected in the round, >= 0.
        answered : int
            Clients whose submission arrived, in [0, cohort_size].
        round_seconds, aggregation_seconds : float
            Wall times of the round and of its aggregation, finite and >= 0.
        local_train_seconds : sequence of float
            Local-training wall time of every answering client (no client identity), each >= 0.
        metrics : mapping of str to float
            Evaluation of the global model; the keys in :data:`ROUND_METRIC_GAUGES` (``loss``,
            ``accuracy``, ``gap``, ``distance``, and the oracle ones ``oracle_loss``, ``oracle_gap``,
            ``oracle_distance``, which the loop hands over only with
            ``monitoring.export_oracle_metrics``) are exported, others ignored. May be empty when
            the round was not evaluated.

        Raises
        ------
        ValueError
            When a value is outside its allowed range; the message names the argument.
        """
        round = _check_count("round", round)
        if epsilon_spent is not None:
            epsilon_spent = _check_nonnegative("epsilon_spent", epsilon_spent, allow_inf=True)
        cohort_size = _check_count("cohort_size", cohort_size)
        answered = _check_count("answered", answered)
        if answered > cohort_size:
            raise ValueError(f"answered={answered}: must be between 0 and cohort_size ({cohort_size})")
        round_seconds = _check_nonnegative("round_seconds", round_seconds)
        aggregation_seconds = _check_nonnegative("aggregation_seconds", aggregation_seconds)
        local = [_check_nonnegative(f"local_train_seconds[{i}]", s) for i, s in enumerate(local_train_seconds)]
        values = {}
        for key, value in metrics.items():
            if key in ROUND_METRIC_GAUGES:
                try:
                    values[ROUND_METRIC_GAUGES[key]] = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"metrics[{key!r}]={value!r}: must be a number") from None

        with self._lock:
            self._child("rfedray_current_round").set(round + 1)
            if epsilon_spent is not None:
                self._child("rfedray_epsilon_spent").set(epsilon_spent)
            self._child("rfedray_cohort_size").set(cohort_size)
            self._child("rfedray_clients_answered").set(answered)
            for name, value in values.items():
                self._child(name).set(value)
            self._child("rfedray_clients_selected").inc(cohort_size)
            self._child("rfedray_round_duration_seconds").observe(round_seconds)
            self._child("rfedray_aggregation_duration_seconds").observe(aggregation_seconds)
            for seconds in local:
                self._child("rfedray_local_train_duration_seconds").observe(seconds)
            self._child("rfedray_rounds_completed").inc()
            self._child("rfedray_last_round_completed_timestamp_seconds").set(time.time())

    def client_failure(self, count: int = 1) -> None:
        """Count ``count`` (>= 0) selected clients that failed to answer."""
        self._child("rfedray_client_failures").inc(_check_count("count", count))

    def submission_rejected(self, count: int = 1) -> None:
        """Count ``count`` (>= 0) submissions the server rejected."""
        self._child("rfedray_submissions_rejected").inc(_check_count("count", count))

    def set_state(self, state: str) -> None:
        """Export the run's state as the one ``rfedray_run_info`` series (``state`` in :data:`RUN_STATES`)."""
        if state not in RUN_STATES:
            raise ValueError(f"state={state!r}: must be one of {', '.join(RUN_STATES)}")
        family = self._families["rfedray_run_info"]
        with self._lock:
            if self.state is not None:
                family.remove(*self.labels.values(), *self.info.values(), self.state)
            family.labels(**self.labels, **self.info, state=state).set(1)
            self.state = state

    def set_client_actors(self, actors: Sequence[Mapping]) -> None:
        """Export where each client actor runs (one ``rfedray_client_actor_device`` series each).

        Parameters
        ----------
        actors : sequence of mapping
            Per actor, in slot order, its ``describe()``: ``node_id``, ``device``, ``gpu_ids``.
        """
        family = self._families["rfedray_client_actor_device"]
        with self._lock:
            family.clear()
            for slot, actor in enumerate(actors):
                family.labels(**self.labels, actor=str(slot), node_id=_check_label("node_id", actor["node_id"]),
                              device=_check_label("device", actor["device"]),
                              gpu_ids=",".join(str(g) for g in actor["gpu_ids"])).set(1)

    def set_halted(self, halted: bool) -> None:
        """Export whether the run has halted (1) or is running (0)."""
        if not isinstance(halted, bool):
            raise ValueError(f"halted={halted!r}: must be True or False")
        self._child("rfedray_halted").set(1 if halted else 0)

    def close(self) -> None:
        """Stop the HTTP endpoint, if started; the registry stays readable. Idempotent."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    def __enter__(self) -> "RunMetrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
