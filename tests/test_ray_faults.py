"""Failures on the Ray engine: killed client actors, missed deadlines, a restarted accountant, a dead
driver resumed from its run directory, and (slow) a lost node.

The module runs on a ``ray.cluster_utils.Cluster`` (a 2-CPU head node) so that the node-loss test
can add and remove nodes; the engine uses that cluster instead of starting its own Ray.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from actors.engine import ray_executor
from rfedray.federated.client import ClientFailure
from rfedray.federated.loop import Federation, run_federation
from rfedray.federated.resume import WriteAheadLedger, accounting_fingerprint
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import initial_params
from test_ray_engine import ROOT, SMALL, run_engine, small_cfg

LONG_ROUNDS = ["federation.clients_per_round=6", "federation.local_steps=120", "run.rounds=4"]


@pytest.fixture(scope="module")
def cluster():
    head = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "object_store_memory": 200 * 1024**2,
    })
    ray.init(address=head.address, log_to_driver=False, logging_level="WARNING")
    yield head
    ray.shutdown()
    head.shutdown()


def stall_local_training():
    """A function to run inside a client actor (``__ray_call__``): the actor's next local training
    first sleeps a minute, so that a kill half a second into the round lands while the task is
    running on any machine. A restarted actor is a fresh instance without the stall. (Built in a
    closure so that cloudpickle ships it by value: the workers cannot import this test module.)"""

    def stall(actor_self):
        inner = actor_self._executor.train

        def stalled(*args, **kwargs):
            time.sleep(60)
            return inner(*args, **kwargs)

        actor_self._executor.train = stalled

    return stall


class KillDuringRound:
    """An executor factory that keeps its Ray executor and kills client actor ``slot`` (Ray restarts
    it) half a second into round ``round_index``, while that actor's task is stalled (so the kill
    cannot miss the round however fast the machine is)."""

    def __init__(self, round_index, slot):
        self.round_index, self.slot = round_index, slot
        self.executor = None

    def __call__(self, fed):
        executor = self.executor = ray_executor(fed)
        inner_train = executor.train

        def train(cohort, theta, round_index, states):
            if round_index == self.round_index:
                actor = executor.pool.actors[self.slot]
                ray.get(actor.__ray_call__.remote(stall_local_training()))
                threading.Timer(0.5, ray.kill, (actor,), {"no_restart": False}).start()
            return inner_train(cohort, theta, round_index, states)

        executor.train = train
        return executor


class FailRounds:
    """An executor factory: the local executor, except that every client of ``rounds`` fails."""

    def __init__(self, rounds):
        self.rounds = set(rounds)

    def __call__(self, fed):
        executor = fed.local_executor()
        inner_train = executor.train

        def train(cohort, theta, round_index, states):
            if round_index in self.rounds:
                return {cid: ClientFailure("lost when the session was killed") for cid in cohort}
            return inner_train(cohort, theta, round_index, states)

        executor.train = train
        return executor


class AtRound:
    """An observer that calls ``action()`` once round ``round_index`` is recorded."""

    def __init__(self, round_index, action):
        self.round_index, self.action = round_index, action

    def on_round(self, record):
        if record["round"] == self.round_index:
            self.action()

    def on_finish(self, summary):
        pass


def actor_pid(actor):
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def charged_epsilon(fed, rounds):
    """The epsilon of ``rounds`` full-participation rounds, from a local ledger."""
    ledger = fed.make_ledger()
    for _ in range(rounds):
        ledger.authorize(range(fed.cfg.federation.n_clients))
    return ledger.epsilon_spent()


def test_client_actor_and_accountant_killed(tmp_path, cluster):
    """Client actor 0 (clients 0-2 of 6, all in every cohort) is killed in round 1: they are
    dropouts there and back in round 2. The accountant is killed after round 2: Ray restarts it,
    it reloads budget.json, and no charge is lost or repeated."""
    killer = KillDuringRound(round_index=1, slot=0)
    pids = []

    def kill_accountant():
        pids.append(actor_pid(killer.executor.accountant))
        ray.kill(killer.executor.accountant, no_restart=False)

    cfg = small_cfg(tmp_path, "run.engine=ray", *LONG_ROUNDS)
    rd = RunDirectory.create(str(tmp_path), "killed")
    observers = [AtRound(2, kill_accountant), AtRound(3, lambda: pids.append(actor_pid(killer.executor.accountant)))]
    summary = run_federation(cfg, rd, observers=observers, executor_factory=killer)
    rounds = rd.read_metrics()
    assert [(r["answered"], r["failed"]) for r in rounds] == [(6, 0), (3, 3), (6, 0), (6, 0)]
    assert summary["client_failures"] == 3
    assert pids[0] != pids[1]
    assert json.loads(rd.budget.read_text())["ledger"]["participations"] == [4] * 6
    assert summary["epsilon_spent"] == charged_epsilon(Federation.prepare(cfg, rd), 4)
    assert torch.isfinite(torch.load(rd.final_model)["subspace"]).all()


def test_round_without_answers_keeps_the_model(tmp_path, cluster):
    summary, theta, rd = run_engine(tmp_path, "deadline", "ray.round_timeout_s=0.01", "ray.num_client_actors=1",
                                    *LONG_ROUNDS)
    cfg = small_cfg(tmp_path)
    start = initial_params(cfg, Federation.prepare(cfg, rd).model)
    assert torch.equal(theta["subspace"], start["subspace"])
    assert all(r["answered"] == 0 and r["failed"] == 6 for r in rd.read_metrics())
    assert summary["epsilon_spent"] > 0 and summary["client_failures"] == 4 * 6


def test_accountant_persists_before_answering_and_charges_a_request_once(tmp_path):
    cfg = small_cfg(tmp_path)
    rd = RunDirectory.create(str(tmp_path), "unit")
    fed = Federation.prepare(cfg, rd)
    fingerprint = accounting_fingerprint(cfg, fed.privacy, fed.sizes)
    accountant = WriteAheadLedger(fed.make_ledger(), fingerprint, rd)
    first = accountant.authorize([0, 1, 2], 1, 0, request="round-0")
    assert json.loads(rd.budget.read_text())["ledger"]["participations"] == [1, 1, 1, 0, 0, 0]
    restarted = WriteAheadLedger(fed.make_ledger(), fingerprint, rd)
    assert restarted.authorize([0, 1, 2], 1, 0, request="round-0") == first
    assert restarted.state_dict()["participations"] == [1, 1, 1, 0, 0, 0]
    restarted.authorize([0, 3], 1, 1, request="round-1")
    assert restarted.state_dict()["participations"] == [2, 1, 1, 1, 0, 0]
    assert restarted.epsilon_spent() >= first.epsilon_after > 0


class DriverDied(Exception):
    pass


def test_resume_after_the_driver_died_never_lowers_epsilon(tmp_path, cluster):
    resumable = ["run.rounds=8", "run.checkpoint_every=3", "ray.num_client_actors=1"]
    reference, theta_ref, _ = run_engine(tmp_path, "reference", *resumable, engine="local")
    cfg = small_cfg(tmp_path, "run.engine=ray", *resumable)
    rd = RunDirectory.create(str(tmp_path), "died")

    def die():
        raise DriverDied()

    with pytest.raises(DriverDied):
        run_federation(cfg, rd, observers=[AtRound(4, die)], executor_factory=ray_executor)
    assert not rd.summary.exists()
    assert rd.read_checkpoint()["round"] == 3
    summary = run_federation(cfg, rd, executor_factory=ray_executor, resume=True)
    assert summary["rounds_completed"] == 8
    assert summary["epsilon_spent"] > reference["epsilon_spent"]  # rounds 3 and 4 were charged twice
    assert torch.equal(torch.load(rd.final_model)["subspace"], theta_ref["subspace"])


def _cli(*args, **kwargs):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "rfedray.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kwargs)


def _kill_session(proc):
    """SIGKILL a CLI run's process group: the driver first, then the Ray processes it started."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_killed_cli_run_resumes(tmp_path):
    extra = ["run.rounds=14", "run.checkpoint_every=3", "federation.local_steps=40"]
    reference, theta_ref, _ = run_engine(tmp_path, "reference", *extra, engine="local")
    proc = _cli("run", *SMALL, f"run.output_dir={tmp_path}", *extra, "--engine", "ray", "--quiet")
    try:
        run_dir = RunDirectory(proc.stdout.readline().strip())
        deadline = time.monotonic() + 240
        while len([r for r in run_dir.read_metrics() if "event" not in r]) < 7:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run is too slow to be killed mid-run"
            time.sleep(0.05)
    finally:
        _kill_session(proc)
    assert not run_dir.summary.exists()
    charged = sum(json.loads(run_dir.budget.read_text())["ledger"]["participations"])
    resumed = _cli("run", "--resume", str(run_dir.path), "--engine", "ray", "--quiet")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    summary = json.loads(run_dir.summary.read_text())
    assert summary["rounds_completed"] == 14 and summary["engine"] == "ray"
    assert summary["epsilon_spent"] >= reference["epsilon_spent"]
    assert sum(json.loads(run_dir.budget.read_text())["ledger"]["participations"]) >= max(charged, 14 * 3)
    final = torch.load(run_dir.final_model)["subspace"]
    # Killing the session can take the client actors down before the server actor: the round it was
    # in is then recorded with its clients as dropouts (model unchanged, budget charged) and may be
    # checkpointed. The resumed model must equal an uninterrupted local run with the same losses.
    rounds = [r for r in run_dir.read_metrics() if "event" not in r]
    whole = sorted({r["round"] for r in rounds if r["failed"] and r["answered"] == 0})
    partial = [r["round"] for r in rounds if r["failed"] and r["answered"] > 0]
    if partial:  # which clients failed is not recorded (no client ids leave a run): no replay
        assert torch.isfinite(final).all() and float((final @ final - final).abs().max()) < 1e-5, partial
    elif whole:
        cfg = small_cfg(tmp_path, "run.engine=local", *extra)
        replay = run_federation(cfg, RunDirectory.create(str(tmp_path), "replay"), executor_factory=FailRounds(whole))
        assert replay["client_failures"] == sum(r["failed"] for r in rounds)
        assert torch.equal(final, torch.load(RunDirectory(tmp_path / "replay").final_model)["subspace"])
    else:
        assert torch.equal(final, theta_ref["subspace"])
    left = subprocess.run(["pgrep", "-g", str(resumed.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"the resumed run left Ray processes behind: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [3, 0])
def test_node_lost_and_capacity_returns(tmp_path, cluster, max_restarts):
    """4 one-CPU client actors on two 2-CPU nodes: SPREAD has to put two on the second node. It is
    removed after round 2 (its actors wait for capacity: Ray restarts them, or with max_restarts=0
    the executor re-creates them) and a new node joins after round 5."""
    second = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    extra = {}

    def lose():
        cluster.remove_node(second, allow_graceful=False)

    def regain():
        extra["node"] = cluster.add_node(num_cpus=2)

    cfg = small_cfg(tmp_path, "run.engine=ray", "federation.n_clients=8", "federation.clients_per_round=8",
                    "run.rounds=12", "ray.num_client_actors=4", "ray.round_timeout_s=20",
                    f"ray.max_restarts={max_restarts}")
    rd = RunDirectory.create(str(tmp_path), f"node-{max_restarts}")
    try:
        summary = run_federation(cfg, rd, observers=[AtRound(2, lose), AtRound(5, regain)],
                                  executor_factory=ray_executor)
    finally:
        if "node" in extra:
            cluster.remove_node(extra["node"])
    rounds = rd.read_metrics()
    assert all(r["failed"] == 0 for r in rounds[:3])
    assert all(r["failed"] == 4 and r["answered"] == 4 for r in rounds[3:6])
    assert rounds[-1]["failed"] == 0 and rounds[-1]["answered"] == 8
    assert summary["rounds_completed"] == 12
    assert json.loads(rd.budget.read_text())["ledger"]["participations"] == [12] * 8
