"""Accountants, calibration, the ledger and the paper's Table 10 (rfedray.privacy)."""

import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rfedray.privacy.accountants import (
    ACCOUNTANTS,
    CLTAccountant,
    ExactAccountant,
    GaussianStep,
    PriRFedAccountant,
    UPPER_BOUNDS,
    calibrate_sigma,
)
from rfedray.privacy.ledger import PrivacyLedger
from rfedray.privacy.plan import GaussianMechanism
from rfedray.privacy.checks import PrivacyParameterError
from rfedray.privacy.gdp import gdp_delta, gdp_epsilon, gdp_mu
from rfedray.privacy.pld import DiscretePLD, subsampled_gaussian_pld
from rfedray.privacy import paper
from tradeoff import subsampled_tradeoff

DELTA = 1e-5
PAPER = dict(batch_size=500, records=5000, local_steps=10, delta=DELTA)


def gaussian_eps(accountant, *, sigma, clip, batch_size, records, rounds, local_steps, delta):
    """The accountant's epsilon for the Gaussian step of a clipped mean."""
    step = GaussianStep.clipped_mean(sigma=sigma, clip=clip, batch_size=batch_size, records=records)
    return accountant.epsilon(step, rounds=rounds, local_steps=local_steps, delta=delta)


def exact_eps(accountant=None, **kw):
    args = dict(sigma=0.0242, clip=paper.PAPER_CLIP, rounds=200, **PAPER)
    args.update(kw)
    return gaussian_eps(accountant or ExactAccountant(), **args)


@pytest.mark.parametrize("mu, eps", [(0.3, 1.0), (1.0, 2.0), (3.0, 10.0), (0.05, 0.2)])
def test_gdp_epsilon_inverts_delta(mu, eps):
    delta = gdp_delta(mu, eps)
    assert gdp_epsilon(mu, delta) == pytest.approx(eps, rel=1e-9)
    assert gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-9)


@pytest.mark.parametrize("mu0, steps", [(0.01, 2000), (0.05, 400), (0.2, 50)])
def test_q_equal_one_is_the_composed_gaussian_mechanism(mu0, steps):
    """q = 1: C_1(G_mu0) = G_mu0 and T tau steps compose to G_{mu0 sqrt(T tau)} exactly."""
    B = 200
    sigma = 2 * 1.0 / (B * mu0)
    exact = gaussian_eps(
        ExactAccountant(discretization=1e-5), sigma=sigma, clip=1.0, batch_size=B, records=B, rounds=steps, local_steps=1, delta=DELTA
    )
    closed = gdp_epsilon(mu0 * math.sqrt(steps), DELTA)
    assert abs(exact - closed) < 1e-6
    assert exact >= closed - 1e-12  # the discretisation is pessimistic


def test_default_discretisation_error_is_second_order_and_pessimistic():
    closed = gdp_epsilon(0.01 * math.sqrt(2000), DELTA)
    errors = []
    for h in (4e-4, 2e-4, 1e-4):
        pld = subsampled_gaussian_pld(0.01, 1.0, h).self_compose(2000)
        errors.append(pld.epsilon(DELTA) - closed)
    assert all(e > 0 for e in errors)
    assert errors[0] / errors[1] == pytest.approx(4, rel=0.1) and errors[1] / errors[2] == pytest.approx(4, rel=0.1)
    assert errors[2] < 2e-5


def test_pld_is_a_distribution_and_symmetric():
    pld = subsampled_gaussian_pld(0.4, 0.1, 1e-4)
    p, losses = pld.probs, pld.losses
    assert p.sum() + pld.infinity_mass == pytest.approx(1.0, abs=1e-12)
    # omega(-l) = exp(-l) omega(l): the mirrored half is the positive half reweighted.
    centre = p.size // 2
    assert losses[centre] == 0
    assert np.allclose(p[:centre][::-1], p[centre + 1:] * np.exp(-losses[centre + 1:]), rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("mu, q", [(0.5, 0.1), (1.0, 0.3), (2.0, 0.05), (0.8, 1.0)])
def test_one_step_matches_the_tradeoff_curve(mu, q):
    """delta(eps) of one step is the conjugate of C_q(G_mu): sup_a 1 - f(a) - e^eps a."""
    pld = subsampled_gaussian_pld(mu, q, 1e-5)
    alpha = np.concatenate([np.geomspace(1e-12, 1e-3, 2000), np.linspace(1e-3, 1, 200001)])
    f = subsampled_tradeoff(alpha, mu, q)
    for eps in (0.0, 0.05, 0.2, 0.5, 1.0):
        curve = float(np.max(1.0 - f - math.exp(eps) * alpha))
        assert pld.delta(eps) == pytest.approx(curve, abs=2e-6)
        assert pld.delta(eps) >= curve - 1e-7


def test_symmetrised_composition_exceeds_one_direction():
    """Composing the 'remove' direction only (a Poisson PLD) under-estimates epsilon."""
    from dp_accounting.pld import privacy_loss_distribution as dpl

    mu0, q, n = 0.4, 0.1, 2000
    ours = subsampled_gaussian_pld(mu0, q, 1e-4).self_compose(n).epsilon(DELTA)
    remove = dpl.from_gaussian_mechanism(
        standard_deviation=1.0 / mu0, sensitivity=1.0, sampling_prob=q, value_discretization_interval=1e-4
    ).self_compose(n).get_epsilon_for_delta(DELTA)
    assert ours > remove * 1.01


def test_fft_composition_matches_dp_accounting_on_the_same_pmf():
    """Our FFT composition and epsilon reading against dp-accounting's, fed the same one-step PMF."""
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

    step = subsampled_gaussian_pld(0.5, 0.2, 1e-3)
    pmf = {int(step.offset + i): float(p) for i, p in enumerate(step.probs) if p > 0}
    theirs = PrivacyLossDistribution.create_from_rounded_probability(pmf, step.infinity_mass, 1e-3)
    for n, delta in ((10, 1e-3), (100, 1e-5)):
        ours_eps = step.self_compose(n).epsilon(delta)
        assert ours_eps == pytest.approx(theirs.self_compose(n).get_epsilon_for_delta(delta), rel=1e-6, abs=1e-9)


def test_gaussian_against_dp_accounting():
    from dp_accounting.pld import privacy_loss_distribution as dpl

    mu0, n = 0.05, 400
    ours = gaussian_eps(ExactAccountant(), sigma=2 / (100 * mu0), clip=1.0, batch_size=100, records=100, rounds=n,
                                     local_steps=1, delta=DELTA)
    theirs = dpl.from_gaussian_mechanism(standard_deviation=1 / mu0, value_discretization_interval=1e-4)
    assert ours == pytest.approx(theirs.self_compose(n).get_epsilon_for_delta(DELTA), rel=1e-4)


def test_identity_and_zero_steps():
    assert DiscretePLD.identity(1e-4).epsilon(DELTA) == 0.0
    for acc in (ExactAccountant(), CLTAccountant(), PriRFedAccountant()):
        assert exact_eps(acc, rounds=0) == 0.0
        assert exact_eps(acc, local_steps=0) == 0.0


CLT_GRID = [(q, nm, n) for q in (0.01, 0.02) for nm in (2.0, 4.0) for n in (500, 2000, 5000)]


@pytest.mark.parametrize("q, noise_multiplier, steps", CLT_GRID)
def test_exact_agrees_with_opacus_gdp_where_the_clt_is_accurate(q, noise_multiplier, steps):
    from opacus.accountants.analysis.gdp import compute_eps_uniform

    B = 100
    sigma = 2 * 1.0 * noise_multiplier / B  # mu0 = 2C / (B sigma) = 1 / noise_multiplier
    kw = dict(sigma=sigma, clip=1.0, batch_size=B, records=round(B / q), rounds=steps, local_steps=1, delta=DELTA)
    theirs = compute_eps_uniform(steps=steps, noise_multiplier=noise_multiplier, sample_rate=q, delta=DELTA)
    assert gaussian_eps(ExactAccountant(), **kw) == pytest.approx(theirs, rel=0.02)
    assert gaussian_eps(CLTAccountant(), **kw) == pytest.approx(theirs, rel=1e-8)


def test_clt_leading_order():
    """mu_tot = 2 C sqrt(T tau) / (m sigma) (1 + O(mu0)), exact in the limit mu0 -> 0."""
    step = GaussianStep.clipped_mean(sigma=0.0242, clip=0.35, batch_size=500, records=5000)
    leading = 2 * 0.35 * math.sqrt(2000) / (5000 * 0.0242)
    assert 1 < CLTAccountant.mu_total(step, 2000) / leading < 1 + step.mu
    tiny = GaussianStep.clipped_mean(sigma=1e6, clip=1.0, batch_size=10, records=100)
    assert CLTAccountant.mu_total(tiny, 4) == pytest.approx(2 * 1.0 * 2 / (100 * 1e6), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    sigma=st.floats(0.5, 4.0),
    factor=st.floats(1.05, 2.0),
    steps=st.integers(1, 300),
    extra=st.integers(1, 100),
    records=st.integers(100, 2000),
    fewer=st.integers(1, 50),
)
def test_exact_is_monotone(sigma, factor, steps, extra, records, fewer):
    acc = ExactAccountant()

    def eps(s=sigma, n=steps, m=records):
        return gaussian_eps(acc, sigma=s, clip=1.0, batch_size=50, records=m, rounds=n, local_steps=1, delta=DELTA)

    base = eps()
    assert eps(n=steps + extra) >= base
    assert eps(s=sigma * factor) <= base
    assert eps(m=max(50, records - fewer)) >= base  # larger q = B/m spends more


@pytest.mark.parametrize("name", list(ACCOUNTANTS))
def test_every_accountant_is_monotone_on_the_paper_setting(name):
    acc = ACCOUNTANTS[name]()
    by_rounds = [exact_eps(acc, rounds=r) for r in (50, 100, 200)]
    by_sigma = [exact_eps(acc, sigma=s) for s in (0.02, 0.03, 0.05)]
    by_q = [exact_eps(acc, records=m) for m in (5000, 2500, 1000)]
    assert by_rounds == sorted(by_rounds) and by_rounds[0] < by_rounds[-1]
    assert by_sigma == sorted(by_sigma, reverse=True) and by_sigma[0] > by_sigma[-1]
    assert by_q == sorted(by_q) and by_q[0] < by_q[-1]


BAD_ARGUMENTS = [
    (dict(delta=0.0), "delta=0.0: must be in (0, 1)"),
    (dict(delta=1.0), "delta=1.0: must be in (0, 1)"),
    (dict(delta=-1e-5), "delta"),
    (dict(sigma=0.0), "sigma=0.0: must be > 0"),
    (dict(sigma=-1.0), "sigma=-1.0: must be > 0"),
    (dict(sigma=float("nan")), "sigma=nan"),
    (dict(clip=0.0), "clip=0.0: must be > 0"),
    (dict(batch_size=600, records=500), "batch_size=600: must be an integer in [1, records=500]"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(records=0), "records=0"),
    (dict(rounds=-1), "rounds=-1: must be an integer >= 0"),
    (dict(local_steps=-2), "local_steps=-2: must be an integer >= 0"),
    (dict(rounds=1.5), "rounds=1.5: must be an integer"),
]


@pytest.mark.parametrize("name", list(ACCOUNTANTS))
@pytest.mark.parametrize("kw, message", BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(name, kw, message):
    with pytest.raises(ValueError) as err:
        exact_eps(ACCOUNTANTS[name](), **kw)
    assert message in str(err.value)
    assert isinstance(err.value, PrivacyParameterError)


@pytest.mark.parametrize("kw, message", [
    (dict(epsilon=0.0), "epsilon=0.0: must be > 0"),
    (dict(epsilon=-1), "epsilon=-1: must be > 0"),
    (dict(delta=2.0), "delta=2.0: must be in (0, 1)"),
    (dict(rounds=0), "rounds=0: must be an integer >= 1"),
    (dict(local_steps=0), "local_steps=0: must be an integer >= 1"),
    (dict(batch_size=501, records=500), "batch_size=501"),
    (dict(clip=-0.1), "clip=-0.1: must be > 0"),
])
def test_calibration_bad_arguments(kw, message):
    args = dict(epsilon=1.0, delta=DELTA, rounds=10, local_steps=10, batch_size=50, records=500, clip=1.0)
    args.update(kw)
    with pytest.raises(ValueError, match=None) as err:
        calibrate_sigma(ExactAccountant(), **args)
    assert message in str(err.value)


def test_exact_discretization_must_be_positive():
    with pytest.raises(ValueError, match=r"discretization=0: must be > 0"):
        ExactAccountant(discretization=0)


@pytest.mark.parametrize("name", UPPER_BOUNDS)
def test_calibration_meets_the_budget_and_is_tight(name):
    acc = ACCOUNTANTS[name]()
    kw = dict(delta=DELTA, rounds=200, local_steps=10, batch_size=500, records=5000, clip=paper.PAPER_CLIP)
    sigma = calibrate_sigma(acc, epsilon=2.0, **kw)
    common = dict(clip=kw["clip"], batch_size=500, records=5000, rounds=200, local_steps=10, delta=DELTA)
    assert gaussian_eps(acc, sigma=sigma, **common) <= 2.0
    assert gaussian_eps(acc, sigma=sigma * (1 - 1e-5), **common) > 2.0


def test_calibration_is_fast_on_the_paper_setting():
    acc = ExactAccountant()
    start = time.process_time()
    calibrate_sigma(acc, epsilon=10.0, delta=DELTA, rounds=200, local_steps=10, batch_size=500, records=5000,
                    clip=paper.PAPER_CLIP)
    assert time.process_time() - start < 2.0


def test_prirfed_composes_the_exact_round_account():
    delta_r = DELTA / (2 * 200)  # each of T = 200 rounds at delta / (2T), slack delta / 2
    # Its accounting of the paper's sigma is the advanced composition of the exact round account.
    sigma = 0.131
    inner = gaussian_eps(ExactAccountant(1e-5), sigma=sigma, clip=paper.PAPER_CLIP, batch_size=500, records=5000,
                         rounds=1, local_steps=10, delta=delta_r)
    total = exact_eps(PriRFedAccountant(), sigma=sigma)
    assert total == pytest.approx(PriRFedAccountant.compose_rounds(inner, 200, DELTA), rel=1e-12)
    assert total == pytest.approx(1.0, rel=0.01)


@pytest.mark.slow
def test_table10_reproduced_within_one_percent_with_the_fitted_clip():
    rows = paper.reproduce(paper.PAPER_CLIP)
    for row in rows:
        assert abs(row.diff_ours) < paper.TOLERANCE
        assert abs(row.diff_prirfed) < paper.TOLERANCE
        assert 5.0 <= row.ratio <= 6.0
    assert paper.fit_clip() == pytest.approx(paper.PAPER_CLIP, abs=5e-5)


def make_ledger(sizes=(5000, 5000, 2000, 3000), target=None, sigma=0.0242, accountant=None, local_steps=10):
    return PrivacyLedger(
        accountant or ExactAccountant(), GaussianMechanism(sigma, paper.PAPER_CLIP, 500), local_steps=local_steps,
        delta=DELTA, epsilon_target=target, client_sizes=list(sizes),
    )


def test_preparing_a_ledger_charges_nothing_and_changes_no_epsilon():
    """PrivacyLedger.prepare (what the accountant actor does when it starts) evaluates the smallest
    client's next epsilon ahead: the state and every charge's epsilon are those of an unprepared ledger."""
    prepared, plain = make_ledger(), make_ledger()
    prepared.prepare()
    assert prepared.state_dict() == plain.state_dict() and prepared.epsilon_spent() == 0.0
    assert (2000, 1) in prepared._epsilons  # client 2, the smallest, at its first participation
    for cohort in ([2, 0], [1, 3], [2, 3]):
        assert prepared.authorize(cohort) == plain.authorize(cohort)
        prepared.prepare()
    assert prepared.state_dict() == plain.state_dict()


def test_ledger_transcript_epsilon_is_the_client_maximum():
    ledger = make_ledger()
    rng = np.random.default_rng(0)
    for _ in range(12):
        cohort = rng.choice(4, size=2, replace=False).tolist()
        auth = ledger.authorize(cohort)
        assert auth.granted
        per_client = [ledger.client_epsilon(i) for i in range(4)]
        assert ledger.epsilon_spent() == pytest.approx(max(per_client), rel=1e-12)
        assert auth.epsilon_after == ledger.epsilon_spent()
    for i, m in enumerate((5000, 5000, 2000, 3000)):
        assert ledger.client_epsilon(i) == exact_eps(records=m, rounds=ledger.participations(i))


def test_ledger_charges_before_training():
    ledger = make_ledger()
    assert ledger.epsilon_spent() == 0.0
    auth = ledger.authorize([0, 2])
    assert auth.granted
    assert [ledger.participations(i) for i in range(4)] == [1, 0, 1, 0]
    state = ledger.state_dict()
    assert state["participations"] == [1, 0, 1, 0]
    assert state["epsilon_spent"] == ledger.epsilon_spent() == ledger.client_epsilon(2) > ledger.client_epsilon(0)


def test_ledger_refuses_at_target_and_charges_nothing():
    target = exact_eps(records=2000, rounds=3)
    ledger = make_ledger(target=target)
    for _ in range(3):
        assert ledger.authorize([1, 2]).granted
    before = ledger.state_dict()
    auth = ledger.authorize([0, 2])
    assert not auth.granted
    assert "client 2" in auth.reason and "m=2000" in auth.reason and "participation 4" in auth.reason
    assert f"{target:g}" in auth.reason
    assert ledger.state_dict() == before
    assert auth.epsilon_after == ledger.epsilon_spent() <= target
    assert ledger.authorize([0, 1]).granted  # client 1 (m=5000) is still below target at its 4th round


def test_calibrated_sigma_allows_exactly_the_planned_rounds():
    acc = ExactAccountant()
    sigma = calibrate_sigma(acc, epsilon=1.0, delta=DELTA, rounds=20, local_steps=10, batch_size=500, records=2000,
                            clip=paper.PAPER_CLIP)
    ledger = make_ledger(sizes=(2000, 5000), target=1.0, sigma=sigma, accountant=acc)
    for _ in range(20):
        assert ledger.authorize([0, 1]).granted
    assert not ledger.authorize([0]).granted
    assert ledger.authorize([1]).granted


def test_ledger_state_survives_save_and_restore():
    ledger = make_ledger(target=5.0)
    for cohort in ([0, 1], [2, 3], [1, 2], [0, 2]):
        ledger.authorize(cohort)
    state = json.loads(json.dumps(ledger.state_dict()))
    restored = make_ledger(target=5.0)
    restored.load_state_dict(state)
    assert restored.state_dict() == ledger.state_dict()
    assert restored.epsilon_spent() == ledger.epsilon_spent()
    assert [restored.participations(i) for i in range(4)] == [2, 2, 3, 1]
    ledger.authorize([3]), restored.authorize([3])
    assert restored.state_dict() == ledger.state_dict()


@pytest.mark.parametrize("field, change", [
    ("sigma", dict(sigma=0.03)),
    ("client_sizes", dict(sizes=(5000, 5000, 2000, 3001))),
    ("accountant", dict(accountant=PriRFedAccountant())),
    ("local_steps", dict(local_steps=5)),
])
def test_ledger_refuses_a_state_of_another_mechanism(field, change):
    ledger = make_ledger()
    ledger.authorize([0])
    other = make_ledger(**change)
    with pytest.raises(ValueError) as err:
        other.load_state_dict(ledger.state_dict())
    assert str(err.value).startswith(f"{field}=")


def test_ledger_bad_arguments():
    ledger = make_ledger()
    with pytest.raises(ValueError, match=r"client=4: must be an integer in \[0, 3\]"):
        ledger.authorize([0, 4])
    with pytest.raises(ValueError, match="must not repeat a client"):
        ledger.authorize([1, 1])
    with pytest.raises(ValueError, match=r"client_sizes\[1\]=100: must be an integer >= batch_size=500"):
        make_ledger(sizes=(5000, 100))
    with pytest.raises(ValueError, match=r"epsilon_target=-1"):
        make_ledger(target=-1)
    with pytest.raises(ValueError, match=r"participations"):
        bad = ledger.state_dict()
        bad["participations"] = [1, -1, 0, 0]
        make_ledger().load_state_dict(bad)
    assert ledger.participations(0) == 0  # nothing was charged by the refused calls


def test_ledger_budget_check_at_2000_steps_is_fast():
    """One round's check when the worst client reaches 200 rounds of 10 steps (2,000 steps).

    It takes about 0.02 s of CPU; on a loaded 2-core machine one timing exceeded 0.05 s in about 1 of
    100 tries (cache and frequency contention), so the check is the fastest of 5 fresh ledgers (each
    computes its epsilon anew): a slow check is slow every time, a load spike does not hit all 5."""
    timings = []
    for _ in range(5):
        ledger = make_ledger(sizes=[5000] * 10, sigma=0.00368, target=10.0)
        state = ledger.state_dict()
        state["participations"] = [199] + [150] * 9
        ledger.load_state_dict(state)
        start = time.process_time()
        auth = ledger.authorize([0, 1, 2])
        timings.append(time.process_time() - start)
        assert auth.granted and ledger.participations(0) == 200
    assert min(timings) < 0.05, timings
