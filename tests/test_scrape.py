"""A real Prometheus server scrapes a real `rfedray run`; what it stored matches summary.json.

Also: nothing a run exports (metrics, logs, summary) carries a per-client data-dependent value.
"""

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from prometheus_server import free_port, prometheus  # noqa: F401  (pytest fixture)
from rfedray.metrics import INFO_LABELS
from rfedray.task import EvalData

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "run.rounds=12", "federation.n_clients=6", "federation.clients_per_round=3", "federation.local_steps=2",
    "federation.batch_size=20", "data.options.d=10", "data.options.p=2", "data.options.records_per_client=100",
    "run.engine=local", "monitoring.linger_seconds=6",
]


def start_run(tmp_path, port, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "rfedray.cli", "run", *RUN, f"run.output_dir={tmp_path}",
         f"monitoring.metrics_port={port}", "--quiet", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_prometheus_stores_what_the_run_reports(tmp_path, prometheus):
    port = free_port()
    server = prometheus(f"127.0.0.1:{port}")
    proc = start_run(tmp_path, port)
    run_dir = Path(proc.stdout.readline().strip())
    deadline = time.time() + 240
    while not (run_dir / "summary.json").is_file():
        if proc.poll() is not None and not (run_dir / "summary.json").is_file():
            pytest.fail(f"run failed: {proc.stderr.read()}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail("run did not finish")
        time.sleep(0.2)
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = server.wait_until("rfedray_rounds_completed_total", lambda v: v == summary["rounds_completed"], timeout=20)
    # Read everything while the run's endpoint is still up (afterwards its series go stale).
    eps = server.value("rfedray_epsilon_spent")
    current = server.value("rfedray_current_round")
    target = server.value("rfedray_epsilon_target")
    halted = server.value("rfedray_halted")
    labels = server.query("rfedray_epsilon_spent")[0]["metric"]
    proc.wait(timeout=60)
    assert rounds == 12 and current == 12
    assert eps == pytest.approx(summary["epsilon_spent"], rel=1e-9)
    assert target == summary["epsilon_target"]
    assert halted == 0
    assert labels["run_id"] == run_dir.name and labels["scheme"] == "projavg"


@pytest.mark.parametrize("test_set", ["clients", "server"])
def test_no_client_value_leaks_through_metrics_logs_or_summary(tmp_path, test_set):
    """Evaluated by the clients (the default; synthetic PCA's clients hold no test split, so no
    metric: ``evaluated_clients`` 0) or by the server (the oracle's metrics, ``metric_oracle_*``)."""
    port = free_port()
    proc = start_run(tmp_path, port, "monitoring.linger_seconds=3", "--verbose", f"run.test_set={test_set}")
    run_dir = Path(proc.stdout.readline().strip())
    body = ""
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            if (run_dir / "summary.json").is_file():
                break
        except OSError:
            pass
        time.sleep(0.3)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    # No series is labelled by client, and no label value is a number (a data-dependent value).
    for line in body.splitlines():
        if line.startswith("rfedray_"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            assert not any(k.startswith("client") for k in labels), line
            assert set(labels) <= {"run_id", "scheme", "dataset", "model", "le", *INFO_LABELS.get(line.split("{")[0], ())}, line
    # metrics.jsonl and summary.json hold only run-level values: no per-client keys.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    allowed = {"round", "cohort_size", "answered", "failed", "rejected", "epsilon_spent", "ledger_charges", "round_seconds",
               "aggregation_seconds", "local_train_seconds", "evaluated_clients",  # a run-level count of clients
               "metric_oracle_loss", "metric_oracle_gap", "metric_oracle_distance"}
    for record in records:
        assert set(record) <= allowed, set(record) - allowed
        assert record["local_train_seconds"] == sorted(record["local_train_seconds"])  # no client order
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not any("client" in key and key not in ("client_failures",) for key in summary)
    # The log never prints records or gradients.
    assert "tensor(" not in stderr
    # No number the run exports is a per-client data-dependent value: every number of summary.json,
    # metrics.jsonl, the exposition and the log differs from each client's records and statistics by
    # more than the precision it was written with.
    exported = [(v, 0.0) for v in (*numbers_in(summary), *numbers_in(records), *exposition_values(body))]
    exported += log_numbers(stderr)
    records_, statistics = client_values(run_dir)
    assert len(exported) > 100 and records_.size > 1000 and statistics.size > 100
    for value, written_to in exported:
        match = private_match(value, written_to, records_, statistics)
        assert match is None, f"exported {value!r} is a client's value {match!r}"


def test_the_leak_check_catches_a_copied_or_recomputed_value_and_nothing_near_it():
    """The precision of the check above. A record copied into JSON, a client's statistic computed by
    torch and the model in float64 or float32, or either printed in the log with 7 decimals, is each
    caught; a value within 1e-7 of one (the coincidence that made a former 1e-7 check fail about one
    run in a hundred: an oracle loss within 8e-8 of one of the 6000 records) is not."""
    import torch

    from rfedray.config import load_config
    from rfedray.federated.loop import Federation

    fed = Federation.prepare(load_config(None, RUN), None)
    theta = fed.model.init_params(torch.Generator().manual_seed(0))
    records_, statistics = private_values(fed, theta)
    (z,) = fed.dataset.client_data(4).train
    record = float(z[17, 3])
    cov32 = z.T @ z / z.shape[0]
    in_float32 = [float(torch.linalg.eigvalsh(cov32)[-1]), fed.model.evaluate(theta, EvalData((cov32,)))["gap"]]

    def caught(value, written_to=0.0):
        return private_match(value, written_to, records_, statistics) is not None

    assert all(caught(v) for v in (record, *in_float32))
    printed = log_numbers(" ".join(f"{v:.7f}" for v in (record, *in_float32)))
    assert len(printed) == 3 and all(caught(*n) for n in printed)
    assert not any(caught(v * (1 + 2e-8)) for v in (record, *in_float32))


def private_match(value: float, written_to: float, records: np.ndarray, statistics: np.ndarray):
    """The private value that ``value``, written to within ``written_to``, equals (or None): a record
    to 1e-12 (a copy of one is exact), a statistic to 1e-9 (:func:`private_values` computes each in
    the two precisions a client might)."""
    for private, rtol in ((records, 1e-12), (statistics, 1e-9)):
        close = np.isclose(private, value, rtol=rtol, atol=written_to)
        if close.any():
            return float(private[close][0])
    return None


def numbers_in(obj) -> list[float]:
    """Every number inside a JSON value."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    items = obj.values() if isinstance(obj, dict) else obj
    return [v for item in items for v in numbers_in(item)]


def exposition_values(body: str) -> list[float]:
    """The sample values of a Prometheus exposition."""
    return [float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith("rfedray_")]


def log_numbers(text: str) -> list[tuple[float, float]]:
    """Numbers printed with at least 6 decimals (rounded ones cannot be matched reliably), each with
    half a unit of its last printed digit."""
    found = re.findall(r"(-?\d+\.(\d{6,}))(?:e(-?\d+))?", text)
    return [(float(f"{m}e{e or 0}"), 0.5 * 10.0 ** (int(e or 0) - len(digits))) for m, digits, e in found]


def client_values(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The private values of a finished run's clients (:func:`private_values` at its final model)."""
    import torch

    from rfedray.config import load_config
    from rfedray.federated.loop import Federation
    from rfedray.federated.rundir import RunDirectory

    fed = Federation.prepare(load_config(run_dir / "config.yaml"), RunDirectory(run_dir))
    return private_values(fed, torch.load(run_dir / "model_final.pt"))


def private_values(fed, theta) -> tuple[np.ndarray, np.ndarray]:
    """What each client's data alone determines: its records (float32: a copy is the value itself),
    and its statistics, computed in float64 and in float32 (either is how a client might compute
    them): its covariance's spectrum and the model ``theta``'s loss, gap and distance on that
    covariance. (Records have unit norm by construction, so norms and traces are not data-dependent
    and are left out.)"""
    import torch

    records, statistics = [], []
    for cid in range(fed.cfg.federation.n_clients):
        (z,) = fed.dataset.client_data(cid).train
        records.append(z.double().flatten())
        for dtype in (torch.float64, torch.float32):
            cov = z.to(dtype).T @ z.to(dtype) / z.shape[0]
            statistics += [torch.linalg.eigvalsh(cov).double(),
                           torch.tensor(list(fed.model.evaluate(theta, EvalData((cov,))).values()), dtype=torch.float64)]
    return torch.cat(records).numpy(), torch.cat(statistics).numpy()
