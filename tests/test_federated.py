"""The federated core in one process: DP-RFedProj on synthetic federated PCA."""

import json

import pytest
import torch

from rfedray.config import ConfigError, load_config
from rfedray.errors import RfedrayError
from rfedray.federated.loop import Federation, run_federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.server import cohort

SMALL = [
    "run.rounds=30", "federation.n_clients=6", "federation.clients_per_round=3",
    "federation.local_steps=3", "federation.batch_size=40", "data.options.d=12",
    "data.options.p=2", "data.options.records_per_client=300", "privacy.noise_seed=7",
    "monitoring.progress=false", "run.test_set=server",  # the oracle: the gap to the pooled optimum
]


def run_cfg(tmp_path, *overrides, name="run"):
    cfg = load_config(None, [*SMALL, f"run.output_dir={tmp_path}", *overrides])
    rd = RunDirectory.create(str(tmp_path), name)
    summary = run_federation(cfg, rd)
    theta = torch.load(rd.final_model)
    return summary, theta, rd


def test_same_seed_same_model(tmp_path):
    s1, t1, _ = run_cfg(tmp_path, name="a")
    s2, t2, _ = run_cfg(tmp_path, name="b")
    assert all(torch.equal(t1[k], t2[k]) for k in t1)
    assert s1["epsilon_spent"] == s2["epsilon_spent"]
    s3, t3, _ = run_cfg(tmp_path, "privacy.noise_seed=8", name="c")
    assert not torch.equal(t1["subspace"], t3["subspace"])


def test_os_entropy_noise_differs_between_runs(tmp_path):
    _, t1, _ = run_cfg(tmp_path, "privacy.noise_seed=null", name="a")
    _, t2, _ = run_cfg(tmp_path, "privacy.noise_seed=null", name="b")
    assert not torch.equal(t1["subspace"], t2["subspace"])


@pytest.mark.parametrize("scheme", ["projavg", "rlavg", "retavg", "kfavg"])
def test_nonprivate_converges_to_true_subspace(tmp_path, scheme):
    summary, _, _ = run_cfg(
        tmp_path, "privacy.enabled=false", f"aggregation.scheme={scheme}", "run.rounds=60",
        "data.options.dtype=float64", "optim.default.lr=0.5",
    )
    assert summary["epsilon_spent"] is None
    assert summary["final_metrics"]["oracle_gap"] < 1e-3


@pytest.mark.parametrize("k", [2, 6])
def test_partial_and_full_participation(tmp_path, k):
    summary, _, rd = run_cfg(tmp_path, f"federation.clients_per_round={k}")
    lines = rd.read_metrics()
    assert len(lines) == 30 and all(line["cohort_size"] == k for line in lines)
    assert summary["rounds_completed"] == 30


def test_cohorts_are_uniform_without_replacement():
    counts = torch.zeros(10)
    for t in range(3000):
        chosen = cohort(0, t, 10, 3)
        assert len(set(chosen)) == 3
        counts[chosen] += 1
    expected = 3000 * 3 / 10
    assert torch.all((counts - expected).abs() < 4 * (expected * 0.7) ** 0.5)


def test_iterates_stay_on_manifold_float32(tmp_path):
    from rfedray.geometry import Grassmann

    _, theta, _ = run_cfg(tmp_path, "run.rounds=200", "federation.local_steps=1", "federation.batch_size=20")
    assert theta["subspace"].dtype == torch.float32
    assert float(Grassmann(12, 2).distance_to_manifold(theta["subspace"].double())) < 1e-6


@pytest.mark.parametrize("optim", [
    ["optim.default.name=rsgd"],
    ["optim.default.name=sgd", "optim.default.momentum=0.9", "optim.default.lr=0.05"],
    ["optim.default.name=adam", "optim.default.lr=0.01"],
    ["optim.default.name=rsgd", "optim.default.schedule=cosine"],
    ["optim.default.name=sgd", "optim.default.schedule=step", "optim.default.step_size=20"],
])
def test_every_optimiser_trains_and_costs_the_same_epsilon(tmp_path, optim):
    summary, theta, _ = run_cfg(tmp_path, *optim)
    reference, _, _ = run_cfg(tmp_path, name="ref")
    assert summary["epsilon_spent"] == reference["epsilon_spent"]
    assert torch.isfinite(theta["subspace"]).all()
    assert summary["final_metrics"]["oracle_gap"] < 0.5


def test_smallest_client_sets_the_budget(tmp_path):
    summary, _, rd = run_cfg(tmp_path, "data.options.size_spread=0.5", "privacy.sigma=0.05", "privacy.epsilon=null")
    fed = Federation.prepare(load_config(rd.config), rd)
    sizes = fed.sizes
    assert len(set(sizes)) > 1
    ledger = fed.make_ledger()
    ledger.load_state_dict(json.loads(rd.budget.read_text())["ledger"])
    per_client = [ledger.client_epsilon(i) for i in range(len(sizes))]
    assert summary["epsilon_spent"] == pytest.approx(max(per_client))


def test_calibrated_run_stays_within_target(tmp_path):
    summary, _, _ = run_cfg(tmp_path, "privacy.epsilon=2.0")
    assert 0 < summary["epsilon_spent"] <= 2.0
    assert summary["halted"] is False


def test_halts_at_target_and_says_why(tmp_path):
    summary, _, rd = run_cfg(tmp_path, "privacy.sigma=0.02", "privacy.epsilon=3.0", "federation.clients_per_round=6")
    assert summary["halted"] is True
    assert "epsilon" in summary["halt_reason"]
    assert summary["rounds_completed"] < 30
    assert summary["epsilon_spent"] <= 3.0
    on_disk = json.loads(rd.summary.read_text())
    assert on_disk["halted"] is True and on_disk["rounds_completed"] == summary["rounds_completed"]


def test_batch_larger_than_smallest_client_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        run_cfg(tmp_path, "federation.batch_size=301")
    assert err.value.field == "federation.batch_size"


def test_resume_continues_and_never_reports_less(tmp_path):
    fixed = ["privacy.sigma=0.05", "privacy.epsilon=null"]
    full, _, _ = run_cfg(tmp_path, "run.checkpoint_every=5", *fixed, name="full")
    cfg = load_config(None, [*SMALL, f"run.output_dir={tmp_path}", "run.checkpoint_every=5", "run.rounds=10", *fixed])
    rd = RunDirectory.create(str(tmp_path), "part")
    run_federation(cfg, rd)
    at_round_10 = rd.checkpoint.read_bytes()
    run_federation(load_config(rd.config, ["run.rounds=12"]), rd, resume=True)
    # A crash after rounds 10 and 11 were charged and trained, before their checkpoint:
    rd.checkpoint.write_bytes(at_round_10)
    resumed = run_federation(load_config(rd.config, ["run.rounds=30"]), rd, resume=True)
    assert resumed["rounds_completed"] == 30
    assert resumed["epsilon_spent"] >= full["epsilon_spent"]
    rounds = [r["round"] for r in rd.read_metrics() if "event" not in r]
    assert rounds == list(range(30))


def test_resume_refuses_changed_accounting(tmp_path):
    _, _, rd = run_cfg(tmp_path, "run.rounds=5", "run.checkpoint_every=5")
    cfg = load_config(rd.config, ["privacy.clip=0.5"])
    with pytest.raises(ConfigError) as err:
        run_federation(cfg, rd, resume=True)
    assert "privacy" in err.value.field


def test_resume_of_corrupt_checkpoint_is_a_clear_error(tmp_path):
    _, _, rd = run_cfg(tmp_path, "run.rounds=5", "run.checkpoint_every=5")
    rd.checkpoint.write_bytes(b"not a checkpoint")
    with pytest.raises(RfedrayError, match="unreadable"):
        run_federation(load_config(rd.config), rd, resume=True)
    assert rd.summary.is_file()


def test_synthetic_pca_records_have_the_chosen_radius():
    from rfedray.config import load_config
    from rfedray.federated.setup import build_dataset

    for radius in (1.0, 0.7):
        cfg = load_config(None, ["data.options.d=8", "data.options.p=2", "data.options.records_per_client=30",
                                 f"data.options.radius={radius}"])
        (z,) = build_dataset(cfg).client_data(0).train
        torch.testing.assert_close(torch.linalg.vector_norm(z, dim=1), torch.full((30,), radius), rtol=1e-6, atol=0)
