"""Statistical audit of the private step against its certified trade-off curve C_q(G_mu0).

Worst-case adjacent datasets (one record replaced, the others equal): every record's gradient is
``-C e1`` except, in D, record 0, whose gradient ``K C e1`` is clipped to ``C e1``. In D' the step's
output is ``-C e1 + noise``; in D it is shifted by ``2C/B e1`` whenever record 0 is sampled (rate
``q = B/m``). These are exactly the "remove" pair ``q N(mu0, 1) + (1 - q) N(0, 1)`` against
``N(0, 1)`` in units of sigma, whose trade-off is ``C_q(G_mu0)`` for false-positive rates up to
``Phi(-mu0/2)``: the audit is tight. The likelihood-ratio test thresholds the e1 coordinate.

For each false-positive level, the Clopper-Pearson upper bound of the empirical FPR (under D')
and the lower bound of the empirical TPR (under D) must satisfy ``TPR <= 1 - f(FPR)``; the same
audit must flag a mechanism whose noise is halved or whose clipping is skipped.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from rfedray.geometry import Euclidean, ProductManifold, Sphere
from rfedray.privacy.mechanism import noise_generator, private_gradient, sample_batch, standard_noise
from tradeoff import subsampled_tradeoff

CLIP, SIGMA, M, B = 1.0, 1.0, 4, 2
MU0 = 2 * CLIP / (B * SIGMA)
Q = B / M
LEVELS = (0.01, 0.05, 0.1, 0.2)
CONFIDENCE = 1e-3  # overall probability of a false alarm (Bonferroni over levels and both bounds)


def linear_loss(params, z):
    """f(theta; z) = <theta, z>: the gradient of a record is the record itself."""
    return (params["theta"] * z).sum()


def datasets(manifold_kind):
    """Point, product and the two adjacent record sets (D with the distinguished record, D')."""
    if manifold_kind == "sphere":
        prod = ProductManifold({"theta": Sphere(3)})
        theta = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
        normal = torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64)  # removed by the tangent projection
    else:
        prod = ProductManifold({"theta": Euclidean(2)})
        theta = torch.zeros(2, dtype=torch.float64)
        normal = torch.zeros(2, dtype=torch.float64)
    e1 = torch.zeros_like(theta)
    e1[0] = 1.0
    others = -CLIP * e1 + normal
    d_prime = others.expand(M, -1).clone()
    d = d_prime.clone()
    d[0] = 3.0 * CLIP * e1 + normal
    return prod, {"theta": theta}, d, d_prime


def statistics(runs, seed, clip=CLIP, sigma=SIGMA, manifold_kind="euclidean"):
    """The e1 coordinate of the step's output in units of the nominal sigma, on D and on D'."""
    prod, params, d, d_prime = datasets(manifold_kind)
    out = []
    for data, offset in ((d, 0), (d_prime, 1)):
        gen = noise_generator(seed * 2 + offset)
        values = np.empty(runs)
        for r in range(runs):
            batch = data[sample_batch(M, B, gen)]
            g = private_gradient(linear_loss, params, prod, (batch,), clip=clip, sigma=sigma,
                                 noise=standard_noise(prod, params, gen))
            values[r] = (float(g["theta"][0]) + CLIP) / SIGMA
        out.append(values)
    return out


def clopper_pearson(successes, trials, tail):
    lower = 0.0 if successes == 0 else stats.beta.ppf(tail, successes, trials - successes + 1)
    upper = 1.0 if successes == trials else stats.beta.ppf(1 - tail, successes + 1, trials - successes)
    return lower, upper


def audit(alt, null, levels=LEVELS):
    """Per level: (fpr_hat, tpr_hat, certified bound at the FPR's upper bound, violated?)."""
    tail = CONFIDENCE / (2 * len(levels))
    report = []
    for alpha in levels:
        threshold = stats.norm.isf(alpha)
        fp, tp = int((null > threshold).sum()), int((alt > threshold).sum())
        _, fpr_up = clopper_pearson(fp, null.size, tail)
        tpr_low, _ = clopper_pearson(tp, alt.size, tail)
        bound = 1.0 - float(subsampled_tradeoff(fpr_up, MU0, Q))
        report.append((fp / null.size, tp / alt.size, bound, tpr_low > bound))
    return report


def test_the_audit_is_tight_for_this_construction():
    """At these levels the certified curve is attained: TPR = q Phi(mu0 - z_alpha) + (1 - q) alpha."""
    for alpha in LEVELS:
        assert alpha <= stats.norm.cdf(-MU0 / 2)
        exact = Q * stats.norm.cdf(MU0 - stats.norm.isf(alpha)) + (1 - Q) * alpha
        assert 1 - float(subsampled_tradeoff(alpha, MU0, Q)) == pytest.approx(exact, rel=1e-9)


def test_step_mechanism_stays_within_its_tradeoff_curve():
    alt, null = statistics(1000, seed=1)
    report = audit(alt, null)
    assert not any(violated for *_, violated in report), report
    # ... and is close to it (the audit has power): empirical TPR near the curve at the nominal level.
    for alpha, (fpr, tpr, _, _) in zip(LEVELS, report):
        exact = Q * stats.norm.cdf(MU0 - stats.norm.isf(alpha)) + (1 - Q) * alpha
        assert abs(tpr - exact) < 5 * math.sqrt(exact * (1 - exact) / alt.size)
        assert abs(fpr - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / null.size)


def test_audit_flags_halved_noise():
    alt, null = statistics(1000, seed=2, sigma=SIGMA / 2)
    assert any(violated for *_, violated in audit(alt, null))


def test_audit_flags_skipped_clipping():
    """Clipping at 3C leaves the distinguished record's gradient 3C e1 whole: the shift doubles."""
    alt, null = statistics(1000, seed=3, clip=3 * CLIP)
    assert any(violated for *_, violated in audit(alt, null))


@pytest.mark.slow
@pytest.mark.parametrize("manifold_kind", ["euclidean", "sphere"])
def test_long_audit(manifold_kind):
    """More levels and runs; subtler breaks (noise x0.75, clip x1.75); also on a sphere, where the
    records' normal components are removed by the tangent projection before clipping."""
    levels = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
    alt, null = statistics(8000, seed=4, manifold_kind=manifold_kind)
    assert not any(violated for *_, violated in audit(alt, null, levels))
    for kw in (dict(sigma=0.75 * SIGMA), dict(clip=1.75 * CLIP)):
        alt, null = statistics(8000, seed=5, manifold_kind=manifold_kind, **kw)
        assert any(violated for *_, violated in audit(alt, null, levels))
