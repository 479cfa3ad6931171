"""The Ray engine against the local engine: same model and epsilon, placement, sticky clients, halting.

One Ray instance (2 CPUs) serves the whole module; the engine uses it instead of starting its own.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

import rfedray
from actors.accountant_actor import RemoteLedger, start_accountant
from actors.client_actor import assign_clients
from actors.engine import ray_executor
from actors.session import check_ray_config
from rfedray.config import ConfigError, load_config
from rfedray.errors import RfedrayError
from rfedray.federated.client import LocalResult
from rfedray.federated.loop import Federation, run_federation
from rfedray.federated.resume import accounting_fingerprint
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.server import cohort

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "run.rounds=6", "federation.n_clients=6", "federation.clients_per_round=3",
    "federation.local_steps=3", "federation.batch_size=40", "data.options.d=12",
    "data.options.p=2", "data.options.records_per_client=300", "privacy.noise_seed=7",
    "privacy.sigma=0.5", "privacy.epsilon=null", "monitoring.progress=false", "run.test_set=server",  # the oracle gap
]


def small_cfg(tmp_path, *overrides):
    return load_config(None, [*SMALL, f"run.output_dir={tmp_path}", *overrides])


def run_engine(tmp_path, name, *overrides, engine="ray", observers=None):
    """Run SMALL on an engine; return the summary, the final model and the run directory."""
    cfg = small_cfg(tmp_path, f"run.engine={engine}", *overrides)
    rd = RunDirectory.create(str(tmp_path), name)
    factory = ray_executor if engine == "ray" else None
    summary = run_federation(cfg, rd, observers=observers, executor_factory=factory)
    return summary, torch.load(rd.final_model), rd


def start_test_ray(**kwargs):
    """A local Ray instance of 2 CPUs for this process (never another process's cluster).

    Ray gives a node 30 s to register; on a 2-core machine loaded by other jobs that can pass, so a
    start that times out is tried once more.
    """
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                     log_to_driver=False, logging_level=logging.WARNING, **kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for this
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    start_test_ray()
    yield
    ray.shutdown()


def test_same_model_and_epsilon_as_local_engine(tmp_path):
    """Bitwise: each client computes the same float operations in its actor (1 torch thread there,
    2 here; these small ops are single-threaded either way), and aggregation runs in the driver."""
    overrides = ["privacy.accountant=exact", "run.rounds=4"]
    local, theta_local, rd_local = run_engine(tmp_path, "local", *overrides, engine="local")
    remote, theta_ray, rd_ray = run_engine(tmp_path, "ray", *overrides)
    assert all(torch.equal(theta_local[k], theta_ray[k]) for k in theta_local)
    assert remote["epsilon_spent"] == local["epsilon_spent"] > 0
    assert remote["engine"] == "ray" and remote["client_failures"] == 0
    keep = ("round", "answered", "failed", "epsilon_spent", "metric_oracle_gap")
    def rounds(rd):
        return [{k: r[k] for k in keep} for r in rd.read_metrics()]

    assert rounds(rd_ray) == rounds(rd_local)
    budget = json.loads(rd_ray.budget.read_text())
    assert sum(budget["ledger"]["participations"]) == 4 * 3


def test_clients_are_sticky_and_built_inside_the_actors(tmp_path):
    cfg = small_cfg(tmp_path, "run.engine=ray", "ray.clients_per_actor=3")
    fed = Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "sticky"))

    def no_records_in_the_driver(client_id):
        raise AssertionError("the driver loaded client records")

    fed.dataset.client_data = no_records_in_the_driver
    executor = ray_executor(fed)
    try:
        before = executor.describe()
        theta = fed.model.init_params(torch.Generator().manual_seed(0))
        answer = ray.get(executor.pool.actors[1].train.remote([3, 5], theta, 0, {}))
        summary = fed.run(executor)
        after = executor.describe()
    finally:
        executor.close()
    assert [a["clients"] for a in before] == [[0, 1, 2], [3, 4, 5]]
    assert [(a["pid"], a["clients"]) for a in after] == [(a["pid"], a["clients"]) for a in before]
    assert all(a["device"] == "cpu" and a["threads"] == 1 for a in before)
    assert summary["client_failures"] == 0 and summary["rounds_completed"] == 6
    assert set(answer) == {3, 5} and all(isinstance(r, LocalResult) for r in answer.values())
    assert all(set(r.submission) == set(theta) and r.submission["subspace"].shape == theta["subspace"].shape
               for r in answer.values())


def test_client_actors_take_the_threads_of_run_threads(tmp_path):
    cfg = small_cfg(tmp_path, "run.engine=ray", "run.threads=2", "ray.num_cpus_per_actor=2")
    executor = ray_executor(Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "threads")))
    try:
        assert [a["threads"] for a in executor.describe()] == [2]
    finally:
        executor.close()


def test_accountant_actor_halts_at_the_target_in_a_placement_group(tmp_path):
    cfg = small_cfg(tmp_path)
    ledger = Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "ledger")).make_ledger()
    per_round = [ledger.authorize(cohort(0, t, 6, 3)).epsilon_after for t in range(5)]
    last = next(t for t in range(2, 5) if per_round[t - 1] < per_round[t])  # the first round refused
    target = (per_round[last - 1] + per_round[last]) / 2
    summary, _, rd = run_engine(tmp_path, "halted", "run.rounds=5", f"privacy.epsilon={target}", "ray.placement=PACK")
    assert summary["halted"] and summary["rounds_completed"] == last
    assert "would reach epsilon" in summary["halt_reason"] and "epsilon_target" in summary["halt_reason"]
    assert json.loads(rd.summary.read_text())["halted"] is True
    assert summary["epsilon_spent"] == per_round[last - 1] <= target
    assert sum(json.loads(rd.budget.read_text())["ledger"]["participations"]) == last * 3


def test_a_round_costs_one_accounting_round_trip_and_the_actor_alone_writes_the_budget(tmp_path):
    """The loop asks the accountant actor once a round (the authorization carries the epsilon and the
    ledger's state), once before round 0 (it writes the new run's ledger files) and once more for the
    summary; budget.json is the actor's (its request ids)."""
    cfg = small_cfg(tmp_path, "run.engine=ray", "run.checkpoint_every=2")
    rd = RunDirectory.create(str(tmp_path), "round-trips")
    fed = Federation.prepare(cfg, rd)
    executor = ray_executor(fed)
    calls = []
    remote = fed.ledger_factory

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self.inner, name)

    fed.ledger_factory = lambda: Counting(remote())
    try:
        summary = fed.run(executor)
    finally:
        executor.close()
    rounds = cfg.run.rounds
    assert summary["rounds_completed"] == rounds
    assert calls.count("authorize") == rounds and calls[0] == "start" and len(calls) == rounds + 2, calls
    saved = json.loads(rd.budget.read_text())
    assert saved["request"]["granted"] and saved["round"] == rounds - 1
    assert saved["ledger"]["participations"] == torch.load(rd.checkpoint, weights_only=True)["ledger"]["participations"]
    assert sum(saved["ledger"]["participations"]) == rounds * cfg.federation.clients_per_round


def test_remote_ledger_raises_the_accountants_errors_as_one_line(tmp_path):
    cfg = small_cfg(tmp_path)
    rd = RunDirectory.create(str(tmp_path), "remote-ledger")
    fed = Federation.prepare(cfg, rd)
    actor = start_accountant(fed.make_ledger(), accounting_fingerprint(cfg, fed.privacy, fed.sizes), rd)
    ledger = RemoteLedger(actor)
    try:
        with pytest.raises(RfedrayError, match="^format='something else': must be"):
            ledger.load_state_dict({"format": "something else"})
        assert ledger.authorize([0, 1]).granted and ledger.state_dict()["participations"][:3] == [1, 1, 0]
    finally:
        ray.kill(actor)


def test_ray_settings_checked_before_start():
    cfg = load_config(None, ["ray.device=cuda"])
    with pytest.raises(ConfigError, match="ray.device"):
        check_ray_config(cfg)
    with pytest.raises(ConfigError, match="ray.num_client_actors"):
        assign_clients(4, load_config(None, ["ray.num_client_actors=5"]).ray, 2)
    with pytest.raises(ConfigError, match="ray.num_client_actors"):
        assign_clients(10, load_config(None, ["ray.clients_per_actor=3", "ray.num_client_actors=2"]).ray, 2)
    assert assign_clients(10, load_config(None, ["ray.clients_per_actor=4"]).ray, 2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert assign_clients(5, load_config(None, []).ray, 2) == [[0, 1, 2], [3, 4]]
    assert assign_clients(5, load_config(None, ["ray.num_cpus_per_actor=0.5"]).ray, 2) == [[0, 1], [2], [3], [4]]


UNUSED_SCRIPTS = {"dashboard/dashboard.py": "dashboard", "autoscaler/_private/monitor.py": "monitor",
                  "_private/log_monitor.py": "log_monitor"}
"""Ray's processes that a local instance of rfedray's stops (:data:`actors.session.UNUSED_PROCESSES`), by script."""


def session_actors(sid: int) -> set[str]:
    """The Ray actors (``ray::Class``) and the :data:`UNUSED_SCRIPTS` among the processes of session ``sid``."""
    names = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = proc.info["cmdline"]
            if os.getsid(proc.pid) != sid or not cmdline or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if cmdline[0].startswith("ray::"):
                names.add(cmdline[0].split()[0].split(".")[0])
            names.update(name for script, name in UNUSED_SCRIPTS.items() if any(a.endswith(script) for a in cmdline))
        except (psutil.Error, OSError):
            continue
    return names


MARKED_PCA = """
import os
from pathlib import Path

from rfedray.data.synthetic_pca import Options, SyntheticPCA


class MarkedPCA(SyntheticPCA):
    \"\"\"Synthetic PCA clients that leave a mark naming the process that loads a client's records.\"\"\"

    def __init__(self, marks):
        super().__init__(Options(d=12, p=2, records_per_client=300), n_clients=6, seed=0)
        self.marks = marks

    def client_data(self, client_id):
        Path(self.marks, f"{client_id}-{os.getpid()}").touch()
        return super().client_data(client_id)
"""

ONE_MACHINE_RUN = """
import sys

sys.path.insert(0, sys.argv[1])
import rfedray
from marked_pca import MarkedPCA

result = rfedray.run(None, *sys.argv[4:], dataset=MarkedPCA(sys.argv[2]), engine="ray", quiet=True)
print(result.run_dir)
"""


def client_loads(marks: Path) -> dict[int, set[int]]:
    """The processes that loaded each client's records (the marks cleared)."""
    loads: dict[int, set[int]] = {}
    for mark in marks.iterdir():
        client, pid = (int(v) for v in mark.name.split("-"))
        loads.setdefault(client, set()).add(pid)
        mark.unlink()
    return loads


def test_a_run_on_its_own_ray_instance_serves_in_the_driver_and_loads_no_client_there(tmp_path):
    """One machine: the driver runs the loop and keeps the ledger (no server or accountant actor),
    but never loads a client's records: every client is loaded where a client actor hosts it (the
    threat model's server holds no records); the local engine's model and epsilon, bit for bit."""
    code, marks = tmp_path / "code", tmp_path / "marks"
    code.mkdir(), marks.mkdir()
    (code / "marked_pca.py").write_text(MARKED_PCA)
    sys.path.insert(0, str(code))
    try:
        from marked_pca import MarkedPCA

        common = [*SMALL, "privacy.accountant=exact", "run.rounds=4", "run.checkpoint_every=2"]
        local = rfedray.run(None, *common, f"run.output_dir={tmp_path / 'local'}", dataset=MarkedPCA(str(marks)),
                            engine="local", quiet=True)
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("marked_pca", None)
    assert set().union(*client_loads(marks).values()) == {os.getpid()}  # the local engine: in its one process

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-c", ONE_MACHINE_RUN, str(code), str(marks), "--", *common,
                             "ray.max_restarts=0", f"run.output_dir={tmp_path / 'ray'}"], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    seen, with_actors = set(), set()
    while proc.poll() is None:
        now = session_actors(proc.pid)
        seen |= now
        if "ray::ClientActor" in now:
            with_actors |= now
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    run_dir = RunDirectory(out.splitlines()[-1])
    placement = json.loads((run_dir.path / "placement.json").read_text())
    assert placement["server"]["pid"] == proc.pid and placement["server"]["accountant"] == "in this process"
    assert [a["clients"] for a in placement["client_actors"]] == [[0, 1, 2], [3, 4, 5]]
    host = {c: actor["pid"] for actor in placement["client_actors"] for c in actor["clients"]}
    assert proc.pid not in host.values() and all(a["threads"] == 1 for a in placement["client_actors"])
    assert client_loads(marks) == {c: {pid} for c, pid in host.items()}  # each client where hosted, none in the driver
    assert "ray::ClientActor" in seen and not seen & {"ray::ServerActor", "ray::AccountantActor"}, seen
    # Ray's dashboard head, autoscaler monitor and log monitor are stopped once Ray is up.
    assert not with_actors & set(UNUSED_SCRIPTS.values()), with_actors
    theta = torch.load(run_dir.final_model)
    assert all(torch.equal(local.final_params[k], theta[k]) for k in local.final_params)
    summary = json.loads(run_dir.summary.read_text())
    assert summary["epsilon_spent"] == local.summary["epsilon_spent"] > 0 and summary["engine"] == "ray"
    assert sum(json.loads(run_dir.budget.read_text())["ledger"]["participations"]) == 4 * 3


@pytest.mark.parametrize("where", ["config", "environment"])
def test_unreachable_address_is_one_clear_line(tmp_path, where):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    extra, label = [f"ray.address={address}"], "ray.address"
    if where == "environment":
        env["RAY_ADDRESS"], extra, label = address, [], "ray.address (from RAY_ADDRESS)"
    out = subprocess.run(
        [sys.executable, "-m", "rfedray.cli", "run", *SMALL, f"run.output_dir={tmp_path}", *extra, "--engine", "ray"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: {label}='{address}': no Ray cluster reachable there")
    assert "Traceback" not in out.stderr
