"""Item 3 of issue 16: metrics computed on the training records are oracles, named so, and kept off
the progress line and Prometheus unless ``monitoring.export_oracle_metrics`` is set.

Federated PCA is evaluated on the pooled training covariance: replacing one record moves the loss
by far more than its float resolution, so the metric alone tells neighbouring datasets apart. Its
metrics are ``oracle_loss``, ``oracle_gap`` and ``oracle_distance`` in ``metrics.jsonl`` and
``summary.json`` (``oracle_metrics: true``); observers (the progress line, the Prometheus endpoint)
see none of them by default. M-estimation's error against the pooled estimator is ``oracle_error``.
"""

from prometheus_client import generate_latest

from rfedray.config import load_config
from rfedray.federated.loop import run_federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.engine import LocalEngine, TaskSpec
from rfedray.mestimation.runner import pooled_m_estimator, run_strategy
from rfedray.mestimation.strategies import FedSGD
from rfedray.observers import MetricsObserver, ProgressObserver

SMALL = [
    "run.rounds=3", "federation.n_clients=4", "federation.clients_per_round=2", "federation.local_steps=2",
    "federation.batch_size=20", "data.options.d=8", "data.options.p=2", "data.options.records_per_client=100",
    "privacy.noise_seed=5", "monitoring.metrics_port=0", "run.test_set=server",
]
ORACLE = {"metric_oracle_loss", "metric_oracle_gap", "metric_oracle_distance"}


class Recorder:
    def __init__(self):
        self.records = []

    def on_round(self, record):
        self.records.append(record)

    def on_finish(self, summary):
        pass


def run(tmp_path, capsys, *overrides):
    """A federated-PCA run watched by a recorder, the Prometheus endpoint and the progress line."""
    cfg = load_config(None, [*SMALL, f"run.output_dir={tmp_path}", *overrides])
    recorder, endpoint, progress = Recorder(), MetricsObserver(cfg, "oracle-test", 1.0), ProgressObserver(cfg, quiet=True)
    rd = RunDirectory.create(str(tmp_path), "run")
    try:
        summary = run_federation(cfg, rd, [recorder, endpoint, progress])
        exposition = generate_latest(endpoint.metrics.registry).decode()
    finally:
        endpoint.close()
    samples = {line.split("{")[0] for line in exposition.splitlines() if line and not line.startswith("#")}
    return summary, rd.read_metrics(), recorder.records, samples, capsys.readouterr().err


def test_oracle_metrics_are_named_oracle_and_stay_off_the_progress_line_and_prometheus(tmp_path, capsys):
    summary, written, observed, samples, progress = run(tmp_path, capsys)
    assert all(set(r) & ORACLE == ORACLE and not any(k in r for k in ("metric_loss", "metric_gap")) for r in written)
    assert summary["oracle_metrics"] is True and set(summary["final_metrics"]) == {"oracle_loss", "oracle_gap",
                                                                                    "oracle_distance"}
    assert observed and not any(k.startswith("metric_") for r in observed for k in r)
    assert not {"rfedray_training_loss", "rfedray_optimality_gap", "rfedray_distance_to_optimum"} & samples
    assert not any("oracle" in name for name in samples) and "rfedray_epsilon_spent" in samples
    assert "round 3/3" in progress and "gap" not in progress and "loss" not in progress


def test_export_oracle_metrics_shows_them_under_their_oracle_names(tmp_path, capsys):
    summary, written, observed, samples, progress = run(tmp_path, capsys, "monitoring.export_oracle_metrics=true")
    assert all(set(r) & ORACLE == ORACLE for r in observed)
    assert {"rfedray_oracle_training_loss", "rfedray_oracle_optimality_gap",
            "rfedray_oracle_distance_to_optimum"} <= samples
    assert not {"rfedray_training_loss", "rfedray_optimality_gap"} & samples
    assert "oracle_gap" in progress


def test_m_estimation_error_against_the_pooled_estimator_is_an_oracle_metric():
    spec = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                    {"dataset": "synthetic_logistic", "records_per_client": 200, "d": 3, "partition": "iid"},
                    {"l2": 1e-2}, 2, 0)
    dataset = spec.build_dataset()
    model = spec.build_model(dataset.info)
    result = run_strategy(FedSGD(lr=1.0), LocalEngine(dataset, model), model, dataset, rounds=2, clients_per_round=2,
                          batch_size=100, reference=pooled_m_estimator(model, dataset.pooled_train()))
    assert all("oracle_error" in r and "error" not in r for r in result["history"])
    assert result["summary"]["oracle_metrics"] is True and "oracle_error" in result["summary"]["final_metrics"]
