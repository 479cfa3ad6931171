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
    assert "rfedray_noise_calibrated == 0" in exprs["RfedrayPrivacyBudgetNearTarget"]
    assert "rfedray_halted == 1" in exprs["RfedrayRunHalted"]
    assert "rfedray_client_failures_total" in exprs["RfedrayClientFailureRate"]
    assert "rfedray_last_round_completed_timestamp_seconds" in exprs["RfedrayNoRoundCompleted"]
    assert 'rfedray_run_info{state="running"}' in exprs["RfedrayRunDriverLost"]
    for rule in rules():
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]  # every rule says how long it waits
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"] and len(notes["runbook"].split()) >= 15, rule["alert"]


def _series(name: str, run: str, values: str, **extra: str) -> dict:
    labels = dict(job="rfedray", instance="127.0.0.1:8000", run_id=run, scheme="projavg", dataset="d", model="m", **extra)
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _info(run: str, state: str, values: str) -> dict:
    return _series("rfedray_run_info", run, values, version="0.1.0", config_digest="0123456789abcdef", state=state)


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
        _series("rfedray_epsilon_spent", "b", "0.5 0.8 0.95 0.95 1.2"),
        _series("rfedray_epsilon_target", "b", "1x4"),
        _series("rfedray_noise_calibrated", "b", "0x4"),  # sigma set by hand: it will halt early
        # A normal run whose sigma was calibrated to end at its target: info, never a warning.
        _series("rfedray_epsilon_spent", "c", "0.5 0.8 0.95 0.99 0.99"),
        _series("rfedray_epsilon_target", "c", "1x4"),
        _series("rfedray_noise_calibrated", "c", "1x4"),
    ]
    halted = [_series("rfedray_halted", "h", "0 0 1")]
    lost = [
        _info("dead", "running", "1 1 1 1 stale"),   # its endpoint vanished while running
        _info("done", "running", "1 1 1 stale"),     # finished: its last state was scraped
        _info("done", "finished", "_ _ _ 1 1 stale"),
        _info("alive", "running", "1x9"),
    ]
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
                {"eval_time": "2m", "alertname": "RfedrayPrivacyBudgetNearTarget", "exp_alerts": []},  # for: 1m
                {"eval_time": "3m", "alertname": "RfedrayPrivacyBudgetNearTarget", "exp_alerts": [_alert("b", "warning")]},
                {"eval_time": "4m", "alertname": "RfedrayPrivacyBudgetMostlySpent", "exp_alerts": [_alert("c", "info")]},
                {"eval_time": "3m", "alertname": "RfedrayPrivacyBudgetExceeded", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "RfedrayPrivacyBudgetExceeded", "exp_alerts": [_alert("b", "critical")]},
            ]},
            {"interval": "1m", "input_series": lost, "alert_rule_test": [
                {"eval_time": "3m", "alertname": "RfedrayRunDriverLost", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "RfedrayRunDriverLost", "exp_alerts": []},  # gone at 4m; for: 1m
                {"eval_time": "6m", "alertname": "RfedrayRunDriverLost", "exp_alerts": [
                    {"exp_labels": dict(job="rfedray", instance="127.0.0.1:8000", run_id="dead", severity="critical")}]},
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


def test_prometheus_yml_scrapes_the_run_and_every_ray_node():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"rfedray", "ray"}
    assert [t for sc in jobs["rfedray"]["static_configs"] for t in sc["targets"]] == ["127.0.0.1:8000"]
    (discovery,) = jobs["ray"]["file_sd_configs"]
    assert discovery["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    readme = README.read_text()
    assert "file_sd_configs" in readme and "RAY_HEAD_IP" not in readme


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
