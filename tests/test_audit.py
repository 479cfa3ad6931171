"""Empirical privacy audit (``rfedray audit``): the real mechanism stays below its claim, broken
ones are caught.

The tiny audits (default run) train a 2-client federated PCA 50 times with a canary and 50 times
without, for the real mechanism and for two broken ones (noise off, clipping off); the full audits
(``-m slow``) use a larger federation and 500 + 500 trials. Trials are seeded, so the numbers are
reproducible; ``-s`` prints them.
"""

import json
import math

import numpy as np
import pytest

from rfedray import cli
from rfedray.audit import (
    AuditPlan, audit, canary_direction, clopper_pearson_upper, describe, epsilon_from_rates, epsilon_lower_bound,
)
from rfedray.config import ConfigError, load_config

TINY = [
    "run.engine=local", "run.rounds=2", "federation.n_clients=2", "federation.clients_per_round=2",
    "federation.local_steps=4", "federation.batch_size=10", "data.options.d=6", "data.options.p=1",
    "data.options.records_per_client=20", "data.options.noise_std=0.01", "data.options.heterogeneity=0",
    "optim.default.lr=0.1", "privacy.epsilon=0.5", "monitoring.progress=false",
]
FULL = [
    "run.engine=local", "run.rounds=3", "federation.n_clients=4", "federation.clients_per_round=2",
    "federation.local_steps=5", "federation.batch_size=10", "data.options.d=10", "data.options.p=1",
    "data.options.records_per_client=20", "data.options.noise_std=0.01", "data.options.heterogeneity=0",
    "optim.default.lr=0.1", "privacy.epsilon=2.0", "monitoring.progress=false",
]
BROKEN = {
    "noise off": dict(noise_scale=1e-3),
    "clipping off": dict(clip_scale=1e4, canary_norm=100.0),
}


def audit_cli(capsys, *argv):
    """``rfedray audit ...`` through the command line's own entry point."""
    code = cli.main(["audit", *argv])
    return code, capsys.readouterr()


def test_clopper_pearson_and_the_epsilon_of_a_perfect_test():
    assert clopper_pearson_upper(0, 25, 0.025) == pytest.approx(1 - 0.025 ** (1 / 25))
    assert clopper_pearson_upper(25, 25, 0.025) == 1.0
    assert clopper_pearson_upper(5, 100, 0.025) > 0.05
    assert epsilon_from_rates(0.1, 0.2, 0.0) == pytest.approx(max(math.log(0.8 / 0.1), math.log(0.9 / 0.2)))
    assert epsilon_from_rates(0.5, 0.5, 1e-5) == 0.0
    null, alt = np.zeros(25), np.ones(25)
    bound = epsilon_lower_bound(null, alt, 0.5, 1e-5, 0.95)
    upper = 1 - 0.025 ** (1 / 25)
    assert bound["fpr"] == bound["fnr"] == 0.0
    assert bound["epsilon_lower"] == pytest.approx(math.log((1 - 1e-5 - upper) / upper))
    assert bound["epsilon_point"] == math.inf


def test_canary_direction_is_orthogonal_to_the_data_and_half_held():
    import torch

    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 8))
    cov = torch.as_tensor(a @ a.T)
    x = torch.as_tensor(np.linalg.qr(rng.standard_normal((8, 2)))[0])
    u = canary_direction(cov, x @ x.T, 2)
    top = torch.linalg.eigh(cov)[1][:, -2:]
    assert float(u.norm()) == pytest.approx(1.0)
    assert float((top.T @ u).norm()) < 1e-10
    assert float(u @ x @ x.T @ u) == pytest.approx(0.5, abs=1e-9)


def test_audit_options_are_checked():
    cfg = load_config(None, TINY)
    for plan, field in ((AuditPlan(trials=2), "--trials"), (AuditPlan(noise_scale=0.0), "--noise-scale"),
                        (AuditPlan(canary_client=5), "--canary-client"), (AuditPlan(confidence=1.0), "--confidence")):
        with pytest.raises(ConfigError) as err:
            audit(cfg, plan)
        assert err.value.field == field
    with pytest.raises(ConfigError, match="privacy.enabled"):
        audit(load_config(None, [*TINY, "privacy.enabled=false"]), AuditPlan(trials=4))


def report(name, result):
    print(f"\n{name}: {describe(result)} [{result['wall_seconds']:.1f} s]")


@pytest.fixture(scope="module")
def tiny_real():
    return audit(load_config(None, TINY), AuditPlan(trials=50, seed=1))


def test_tiny_audit_of_the_real_mechanism_stays_below_the_claim(tiny_real):
    report("tiny, real mechanism", tiny_real)
    assert 0.0 <= tiny_real["epsilon_lower"] < tiny_real["epsilon_claimed"]
    assert not tiny_real["violated"]
    assert tiny_real["epsilon_claimed"] <= 0.5 + 1e-9 and tiny_real["rounds"] == 2


@pytest.mark.parametrize("broken", BROKEN)
def test_tiny_audit_catches_a_broken_mechanism(broken, tiny_real, capsys):
    """Through ``rfedray audit --json``: exit status 1 and a lower bound above the claim."""
    options = BROKEN[broken]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    code, out = audit_cli(capsys, *TINY, "--trials=50", "--seed=1", "--json", *flags)
    result = json.loads(out.out)
    report(f"tiny, {broken}", {**result, "epsilon_point": result["epsilon_point"] or math.inf})
    assert code == 1 and result["violated"] is True
    assert result["epsilon_lower"] > result["epsilon_claimed"] == pytest.approx(tiny_real["epsilon_claimed"])
    assert result["sigma_claimed"] == pytest.approx(tiny_real["sigma_claimed"])


@pytest.mark.slow
def test_full_audit(capsys):
    cfg = load_config(None, FULL)
    real = audit(cfg, AuditPlan(trials=500, seed=2))
    report("full, real mechanism", real)
    assert real["epsilon_lower"] < real["epsilon_claimed"] and not real["violated"]
    for name, options in BROKEN.items():
        broken = audit(cfg, AuditPlan(trials=500, seed=3, **options))
        report(f"full, {name}", broken)
        assert broken["epsilon_lower"] > broken["epsilon_claimed"] and broken["violated"]
