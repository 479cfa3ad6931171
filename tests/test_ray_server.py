"""The server actor: it runs the federation on the driver's node, and the driver only follows it.

Same model and epsilon as the local engine, progress and warnings relayed to the driver, metrics
served from the server actor's process, the server's errors raised in the driver with their message,
and a killed server: one clear line, then ``rfedray run --resume`` finishes the run.

One Ray instance (2 CPUs) serves the whole module, the command line runs of the last test included.
"""

import json
import logging
import os
import threading
import time
import urllib.request

import psutil
import pytest
import ray
import threadpoolctl
import torch
from prometheus_client.parser import text_string_to_metric_families

from actors.driver import run_on_ray
from actors.server_actor import SERVER_NAMESPACE, serve
from actors.session import RaySession
from prometheus_server import free_port
from rfedray.cli import main
from rfedray.errors import RfedrayError
from rfedray.federated.loop import Federation, without_oracle_metrics
from rfedray.federated.rundir import RunDirectory
from rfedray.threads import use_threads
from test_ray_engine import SMALL, run_engine, small_cfg, start_test_ray

SLOW_ROUNDS = ["run.rounds=12", "run.checkpoint_every=3", "federation.local_steps=40"]


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    start_test_ray()
    yield
    ray.shutdown()


class Recorder:
    """An observer that keeps what the driver relays."""

    def __init__(self):
        self.records, self.summaries = [], []

    def on_round(self, record):
        self.records.append(record)

    def on_finish(self, summary):
        self.summaries.append(summary)


def run_server(tmp_path, name, *overrides, observers=()):
    cfg = small_cfg(tmp_path, "run.engine=ray", *overrides)
    rd = RunDirectory.create(str(tmp_path), name)
    return run_on_ray(Federation.prepare(cfg, rd), list(observers)), rd


def scrape(port):
    """``{sample name: value}`` of the endpoint at ``port``, or None while nothing answers there."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def series(port, name):
    """The label sets of metric ``name`` at the endpoint on ``port`` ([] while nothing answers there)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return []
    return [s.labels for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_same_model_as_the_local_engine_with_progress_and_warnings_relayed(tmp_path, caplog):
    overrides = ["privacy.accountant=exact", "run.rounds=4"]
    local, theta_local, _ = run_engine(tmp_path, "local", *overrides, engine="local")
    recorder = Recorder()
    with caplog.at_level(logging.WARNING):
        summary, rd = run_server(tmp_path, "server", *overrides, observers=[recorder])
    theta = torch.load(rd.final_model)
    assert all(torch.equal(theta_local[k], theta[k]) for k in theta_local)
    assert summary["epsilon_spent"] == local["epsilon_spent"] > 0 and summary["engine"] == "ray"
    assert recorder.summaries == [summary] == [json.loads(rd.summary.read_text())]
    logged = [{k: v for k, v in r.items() if k != "local_train_seconds"} for r in rd.read_metrics()]
    assert any(k.startswith("metric_oracle_") for k in logged[-1])
    # Observers (progress line, Prometheus) get each round's record without its oracle metrics.
    assert recorder.records == [without_oracle_metrics(r) for r in logged] and [r["round"] for r in logged] == [0, 1, 2, 3]
    assert any(r.name == "rfedray.federated.loop" and "NOT FOR PRODUCTION" in r.getMessage() for r in caplog.records)
    placement = json.loads((rd.path / "placement.json").read_text())
    here = ray.get_runtime_context().get_node_id()
    assert placement["server"]["node_id"] == here and placement["server"]["pid"] != os.getpid()
    assert [a["clients"] for a in placement["client_actors"]] == [[0, 1, 2], [3, 4, 5]]


def test_the_process_that_serves_takes_the_threads_of_the_local_engine(tmp_path):
    """One torch and one BLAS thread for federated PCA's small kernels (its 2 BLAS threads spun on a busy
    machine), as the local engine's process; placement.json records them."""
    use_threads(2)  # what a driver has on 2 CPUs before it serves
    cfg = small_cfg(tmp_path, "run.engine=ray", "run.rounds=2")
    fed = Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "threads"))
    serve(fed, RaySession(started=False), resume=False)
    blas = [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]
    assert torch.get_num_threads() == 1 and blas and set(blas) == {1}
    assert json.loads((fed.run_dir.path / "placement.json").read_text())["server"]["threads"] == 1


def test_metrics_are_served_by_the_server_actor(tmp_path):
    port = free_port()
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(zip(("summary", "rd"), run_server(
        tmp_path, "metrics", "run.rounds=5", f"monitoring.metrics_port={port}", "monitoring.linger_seconds=3"))))
    thread.start()
    deadline = time.monotonic() + 120
    while (values := scrape(port)) is None or values.get("rfedray_rounds_completed_total") != 5:
        assert thread.is_alive() and time.monotonic() < deadline, "the endpoint never reported 5 rounds"
        time.sleep(0.1)
    (listener,) = [c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"]
    devices = series(port, "rfedray_client_actor_device")
    while (info := series(port, "rfedray_run_info")) and info[0]["state"] == "running":
        time.sleep(0.1)  # the run ends; its endpoint lingers 3 s with the final state
    thread.join(timeout=60)
    placement = json.loads((outcome["rd"].path / "placement.json").read_text())
    assert listener == placement["server"]["pid"] != os.getpid()
    assert [i["state"] for i in info] == ["finished"] and info[0]["version"] == "0.1.0"
    assert [(d["actor"], d["node_id"], d["device"], d["gpu_ids"]) for d in devices] == [
        (str(slot), a["node_id"], a["device"], "") for slot, a in enumerate(placement["client_actors"])]
    assert values["rfedray_epsilon_spent"] == pytest.approx(outcome["summary"]["epsilon_spent"], rel=1e-12)
    assert scrape(port) is None  # closed once the linger is over


def test_errors_of_the_server_reach_the_driver_intact(tmp_path):
    rd = RunDirectory.create(str(tmp_path), "error")
    fed = Federation.prepare(small_cfg(tmp_path, "run.engine=ray"), rd)
    fed.cfg = small_cfg(tmp_path, "run.engine=ray", "data.options.records_per_client=30")  # what the server prepares
    with pytest.raises(RfedrayError, match=r"^federation.batch_size=40: must be <= the smallest client's"):
        run_on_ray(fed, [])
    assert list((tmp_path / "error").iterdir()) == []


def kill_server_after(output_dir, rounds):
    """Kill the server actor of the run in ``output_dir`` once it has logged ``rounds`` rounds."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for metrics in output_dir.glob("*/metrics.jsonl"):
            if metrics.read_text().count("\n") >= rounds:
                ray.kill(ray.get_actor(f"server-{metrics.parent.name}", namespace=SERVER_NAMESPACE))
                return
        time.sleep(0.02)


def test_killed_server_is_one_line_and_resume_never_lowers_epsilon(tmp_path, capsys):
    reference, theta_ref, _ = run_engine(tmp_path, "reference", *SLOW_ROUNDS, engine="local")
    output_dir = tmp_path / "cli"
    killer = threading.Thread(target=kill_server_after, args=(output_dir, 4))
    killer.start()
    code = main(["run", *SMALL, f"run.output_dir={output_dir}", *SLOW_ROUNDS, "run.engine=ray", "--quiet"])
    killer.join()
    out, err = capsys.readouterr()
    run_dir = RunDirectory(out.splitlines()[0])
    *progress, line = err.strip().splitlines()
    assert code == 1 and all(p.startswith(("round ", "WARNING ")) for p in progress), err  # a runtime failure
    assert line.startswith("error: the federation server actor died (ActorDiedError: ")
    assert line.endswith(f"continue with rfedray run --resume {run_dir.path}")
    assert not run_dir.summary.exists() and run_dir.read_checkpoint()["round"] in (3, 6, 9)
    charged = sum(json.loads(run_dir.budget.read_text())["ledger"]["participations"])

    assert main(["run", "--resume", str(run_dir.path), "--quiet"]) == 0
    summary = json.loads(run_dir.summary.read_text())
    assert summary["rounds_completed"] == 12 and summary["engine"] == "ray"
    assert summary["epsilon_spent"] >= reference["epsilon_spent"]
    assert sum(json.loads(run_dir.budget.read_text())["ledger"]["participations"]) >= max(charged, 12 * 3)
    assert torch.equal(torch.load(run_dir.final_model)["subspace"], theta_ref["subspace"])
