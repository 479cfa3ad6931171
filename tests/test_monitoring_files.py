"""monitoring/: the Prometheus configuration, the alert rules and the Grafana dashboard.

promtool checks the configuration and the rules and runs unit tests of every alert; each metric the
rules and the dashboard query must be one rfedray.metrics exports. promtool comes with Debian's
prometheus package (``scripts/setup.sh --test``); without it these tests fail, they never skip.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from prometheus_server import require_binary
from rfedray.metrics import LABELS, METRIC_NAMES

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
PROMETHEUS_YML = MONITORING / "prometheus.yml"
ALERTS_YML = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana" / "rfedray-dashboard.json"
README = MONITORING / "README.md"

METRIC_RE = re.compile(r"\brfedray_[a-zA-Z0-9_]+")


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS_YML.read_text())["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            queries.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return queries


def test_promtool_accepts_the_configuration_and_its_rule_files():
    result = promtool("check", "config", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "1 rule files found" in result.stdout


def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", str(ALERTS_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_rules_and_dashboard_use_only_exported_metrics():
    for source, exprs in (("alerts.yml", [r["expr"] for r in rules()]), ("dashboard", dashboard_queries())):
        assert exprs, source
        for expr in exprs:
            names = set(METRIC_RE.findall(expr))
            assert names, f"{source}: {expr!r} uses no rfedray metric"
            assert names <= METRIC_NAMES, f"{source}: {sorted(names - METRIC_NAMES)} not exported by rfedray.metrics"


def test_the_required_alerts_exist():
    exprs = {r["alert"]: r["expr"] for r in rules()}
    assert "rfedray_epsilon_spent > 0.9 * rfedray_epsilon_target" in exprs["RfedrayPrivacyBudgetNearTarget"]
    assert "rfedray_halted == 1" in exprs["RfedrayRunHalted"]
    assert "rfedray_client_failures_total" in exprs["RfedrayClientFailureRate"]
    assert "rfedray_last_round_completed_timestamp_seconds" in exprs["RfedrayNoRoundCompleted"]
    for rule in rules():
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def _series(name: str, run: str, values: str) -> dict:
    labels = dict(job="rfedray", instance="127.0.0.1:8000", run_id=run, scheme="projavg", dataset="d", model="m")
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _alert(run: str, severity: str) -> dict:
    labels = dict(job="rfedray", instance="127.0.0.1:8000", run_id=run, scheme="projavg", dataset="d", model="m")
    return {"exp_labels": dict(labels, severity=severity)}


def test_every_alert_fires_when_it_should_and_only_then(tmp_path):
    """promtool unit tests of the rules' expressions (annotations are templates, checked above)."""
    stripped = yaml.safe_load(ALERTS_YML.read_text())
    for group in stripped["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(stripped))
    budget = [
        _series("rfedray_epsilon_spent", "b", "0.5 0.8 0.95 1.2"),
        _series("rfedray_epsilon_target", "b", "1x3"),
    ]
    halted = [_series("rfedray_halted", "h", "0 0 1")]
    failures = [
        _series("rfedray_client_failures_total", "ok", "0+1x30"),
        _series("rfedray_clients_selected_total", "ok", "0+10x30"),
        _series("rfedray_client_failures_total", "bad", "0+5x30"),
        _series("rfedray_clients_selected_total", "bad", "0+10x30"),
    ]
    stall = [
        _series("rfedray_run_start_timestamp_seconds", "stuck", "0x40"),
        _series("rfedray_halted", "stuck", "0x40"),
        _series("rfedray_run_start_timestamp_seconds", "moving", "0x40"),
        _series("rfedray_last_round_completed_timestamp_seconds", "moving", "0+60x40"),
        _series("rfedray_halted", "moving", "0x40"),
        _series("rfedray_run_start_timestamp_seconds", "stopped", "0x40"),
        _series("rfedray_halted", "stopped", "1x40"),
    ]
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": budget, "alert_rule_test": [
                {"eval_time": "1m", "alertname": "RfedrayPrivacyBudgetNearTarget", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "RfedrayPrivacyBudgetNearTarget", "exp_alerts": [_alert("b", "warning")]},
                {"eval_time": "2m", "alertname": "RfedrayPrivacyBudgetExceeded", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "RfedrayPrivacyBudgetExceeded", "exp_alerts": [_alert("b", "critical")]},
            ]},
            {"interval": "1m", "input_series": halted, "alert_rule_test": [
                {"eval_time": "1m", "alertname": "RfedrayRunHalted", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "RfedrayRunHalted", "exp_alerts": [_alert("h", "warning")]},
            ]},
            {"interval": "1m", "input_series": failures, "alert_rule_test": [
                {"eval_time": "20m", "alertname": "RfedrayClientFailureRate", "exp_alerts": [_alert("bad", "warning")]},
            ]},
            {"interval": "1m", "input_series": stall, "alert_rule_test": [
                {"eval_time": "10m", "alertname": "RfedrayNoRoundCompleted", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "RfedrayNoRoundCompleted", "exp_alerts": [_alert("stuck", "critical")]},
            ]},
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_yml_scrapes_a_local_run_and_the_cluster_head():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in config["scrape_configs"]}
    assert targets["rfedray-local"] == ["127.0.0.1:8000"]
    assert targets["rfedray-cluster"] == ["RAY_HEAD_IP:8000"]
    assert targets["ray-head"] == ["RAY_HEAD_IP:8080"]
    readme = README.read_text()
    assert "RAY_HEAD_IP" in readme and "ray get-head-ip" in readme


def test_dashboard_shows_what_a_run_needs():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and "run_id" in variables
    assert "run_id" in LABELS

    by_title = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dash["panels"]}
    joined = list(by_title.values())
    assert any("rfedray_epsilon_spent" in e and "rfedray_epsilon_target" in e for e in joined)
    assert any("rfedray_test_accuracy" in e for e in joined)
    assert any("rfedray_optimality_gap" in e for e in joined)
    quantiles = [e for e in joined if "histogram_quantile" in e and "rfedray_round_duration_seconds_bucket" in e]
    assert quantiles and all(f"histogram_quantile({q}," in quantiles[0] for q in ("0.5", "0.9", "0.99"))
    assert any("rfedray_client_failures_total" in e for e in joined)


@pytest.mark.parametrize("phrase", ["ray.util.metrics", "WorkerId", "prometheus_client", "metrics_port"])
def test_readme_explains_the_exporter(phrase):
    assert phrase in README.read_text()
