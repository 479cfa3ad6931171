"""Issue 18: a real Prometheus running monitoring/prometheus.yml scrapes every node of a Ray cluster.

A two-node ``ray.cluster_utils.Cluster`` (a head with the dashboard, which writes Ray's
service-discovery file, and a second node), each with its own metrics export port; a Ray run with two
client actors spread over both nodes and its metrics endpoint on; a real Prometheus (Debian's) with
the repository's ``prometheus.yml`` and ``alerts.yml``, only its two paths adapted (the session's
discovery file, the run's port). It discovers and scrapes both nodes' Ray metrics (job ``ray``) and
the run's (job ``rfedray``): rounds, the client actors' devices on the two nodes, and the final
state ``finished``.
"""

import json
import math
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from actors.driver import run_on_ray
from prometheus_server import free_port, prometheus  # noqa: F401  (pytest fixture)
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from test_ray_engine import small_cfg

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
ROUNDS = 8


@pytest.fixture
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head": 1}, "include_dashboard": True, "dashboard_port": free_port(),
        "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
    })
    cluster.add_node(num_cpus=1, resources={"worker": 1}, metrics_export_port=free_port())
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def repository_config(discovery_file: Path, run_port: int) -> dict:
    """monitoring/prometheus.yml with the session's discovery file and the run's port (its rules by absolute path)."""
    text = (MONITORING / "prometheus.yml").read_text()
    text = text.replace("/tmp/ray/prom_metrics_service_discovery.json", str(discovery_file))
    text = text.replace("127.0.0.1:8000", f"127.0.0.1:{run_port}")
    config = yaml.safe_load(text)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        for discovery in job.get("file_sd_configs", []):
            discovery["refresh_interval"] = "1s"
    config["rule_files"] = [str(MONITORING / name) for name in config["rule_files"]]
    return config


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


def test_prometheus_scrapes_both_nodes_ray_metrics_and_the_runs(two_nodes, tmp_path, prometheus):
    session = Path(two_nodes.head_node.get_session_dir_path())
    discovery = wait_for(lambda: (session / "prom_metrics_service_discovery.json").is_file() and
                         session / "prom_metrics_service_discovery.json", 120, "Ray wrote no discovery file")
    nodes = {f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}": n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    wait_for(lambda: set(nodes) <= set(json.loads(discovery.read_text())[0]["targets"]), 60,
             "the discovery file does not list both nodes")

    port = free_port()
    server = prometheus(f"127.0.0.1:{port}", config=repository_config(discovery, port))
    cfg = small_cfg(tmp_path, "run.engine=ray", f"run.rounds={ROUNDS}", "ray.num_client_actors=2",
                    "ray.placement=STRICT_SPREAD", f"monitoring.metrics_port={port}", "monitoring.linger_seconds=8")
    run_dir = RunDirectory.create(str(tmp_path), "scraped")
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(summary=run_on_ray(Federation.prepare(cfg, run_dir), [])))
    thread.start()
    try:
        # The run's series, its final state and where its actors ran, scraped from its endpoint.
        server.wait_until("rfedray_rounds_completed_total", lambda v: v == ROUNDS, timeout=300)
        server.wait_until('count(rfedray_run_info{state="finished"})', lambda v: v == 1, timeout=60)
        devices = server.query('rfedray_client_actor_device{job="rfedray"}')
    finally:
        thread.join(timeout=120)
    assert outcome["summary"]["rounds_completed"] == ROUNDS
    assert sorted(d["metric"]["node_id"] for d in devices) == sorted(nodes.values())  # one actor per node
    assert {d["metric"]["device"] for d in devices} == {"cpu"}

    # Ray's own metrics of both nodes, from targets the discovery file named.
    up = {t["labels"]["instance"]: t["health"] for t in server.targets() if t["labels"]["job"] == "ray"}
    assert set(nodes) <= set(up), up
    server.wait_until(f'count(up{{job="ray",instance=~"{"|".join(nodes)}"}} == 1)', lambda v: v == 2, timeout=60)
    per_node = server.wait_until(
        f'count(count by (instance) ({{job="ray",instance=~"{"|".join(nodes)}",__name__=~"ray_node_.+"}}))',
        lambda v: v == 2, timeout=60)
    assert math.isclose(per_node, 2)
    # The alert rules were loaded with the configuration.
    assert {r["name"] for g in server._api("rules", {})["groups"] for r in g["rules"]} >= {
        "RfedrayRunDriverLost", "RfedrayPrivacyBudgetNearTarget", "RfedrayNoRoundCompleted"}
