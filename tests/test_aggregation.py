"""The four aggregation schemes on a product manifold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfedray import config
from rfedray.aggregation import SCHEMES, KFAvg, ProjAvg, RetAvg, RLAvg, combine, submit
from rfedray.geometry import STIEFEL_RETRACTIONS, Euclidean, Grassmann, ProductManifold, Sphere, Stiefel

F64 = torch.float64
ALL = list(SCHEMES.values())



def product(retraction: str = "polar") -> ProductManifold:
    return ProductManifold(
        {
            "bimap": Stiefel(6, 3, retraction=STIEFEL_RETRACTIONS[retraction]),
            "head": Euclidean(4, 2),
            "pca": Grassmann(5, 2),
            "dir": Sphere(4),
        }
    )


def tangent(prod: ProductManifold, x: dict, g: torch.Generator, scale: float) -> dict:
    """A random tangent vector at ``x`` of joint norm ``scale``."""
    z = {k: torch.randn(m.shape, generator=g, dtype=x[k].dtype) for k, m in prod.groups.items()}
    v = prod.proj_tangent(x, z)
    n = float(prod.norm(v))
    return {k: t * (scale / n) for k, t in v.items()}


def clients_near(prod: ProductManifold, theta: dict, g: torch.Generator, k: int, eps: float) -> list[dict]:
    return [prod.retract(theta, tangent(prod, theta, g, eps)) for _ in range(k)]


def aggregate(scheme, prod: ProductManifold, theta: dict, local: list[dict], weights=None) -> dict:
    return combine(scheme, prod, theta, [submit(scheme, prod, theta, y) for y in local], weights)


def distance(prod: ProductManifold, x: dict) -> float:
    """Largest distance to the manifold over the groups, measured in float64."""
    return max(float(d.max()) for d in prod.distance_to_manifold({k: t.double() for k, t in x.items()}).values())


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(ALL), st.sampled_from(["polar", "qr"]), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_schemes_return_points_on_the_manifold(scheme, retraction, k, seed):
    g = torch.Generator().manual_seed(seed)
    prod = product(retraction)
    theta = prod.random_point(generator=g)
    local = clients_near(prod, theta, g, k, 0.3)
    weights = torch.rand(k, generator=g, dtype=F64).add(0.1).tolist()
    out = aggregate(scheme, prod, theta, local, weights)
    assert distance(prod, out) < 1e-10


@pytest.mark.parametrize("scheme", ALL, ids=lambda s: s.name)
def test_float32_stays_on_the_manifold_over_1000_rounds(scheme):
    g = torch.Generator().manual_seed(0)
    prod = ProductManifold({"bimap": Stiefel(5, 3), "head": Euclidean(2, 2), "pca": Grassmann(4, 2), "dir": Sphere(3)})
    theta = prod.random_point(generator=g, dtype=torch.float32)
    worst = 0.0
    for _ in range(1000):
        noise = {k: 0.03 * torch.randn(3, *m.shape, generator=g) for k, m in prod.groups.items()}
        stacked = prod.retract(theta, prod.proj_tangent(theta, noise))
        subs = submit(scheme, prod, theta, stacked)
        theta = combine(scheme, prod, theta, [{k: t[i] for k, t in subs.items()} for i in range(3)])
        worst = max(worst, distance(prod, theta))
    assert all(t.dtype == torch.float32 for t in theta.values())
    assert worst < 1e-6


@pytest.mark.parametrize("retraction", ["polar", "qr"])
def test_schemes_agree_to_first_order_when_clients_are_close(retraction):
    g = torch.Generator().manual_seed(1)
    prod = product(retraction)
    theta = prod.random_point(generator=g)
    for eps in (1e-2, 1e-3):
        local = clients_near(prod, theta, g, 5, eps)
        outs = [aggregate(s, prod, theta, local) for s in ALL]
        moved = max_diff(outs[0], theta)
        assert eps / 10 < moved < 2 * eps
        for out in outs[1:]:
            assert max_diff(out, outs[0]) < 5 * eps**2


@pytest.mark.parametrize("retraction", ["polar", "qr"])
@pytest.mark.parametrize("scheme", [ProjAvg, RetAvg, KFAvg], ids=lambda s: s.name)
def test_exact_schemes_return_the_common_iterate(scheme, retraction):
    g = torch.Generator().manual_seed(2)
    prod = product(retraction)
    theta = prod.random_point(generator=g)
    y = prod.exp(theta, tangent(prod, theta, g, 0.4))
    out = aggregate(scheme, prod, theta, [y, y, y], [1.0, 2.0, 3.0])
    assert max_diff(out, y) < 1e-10


def test_rlavg_returns_the_common_iterate_to_third_order():
    """RLAvg lifts by P_theta, not by the inverse of Pi(theta + .), so a common iterate y comes back
    exactly only when y = theta, and otherwise up to O(|y - theta|^3)."""
    g = torch.Generator().manual_seed(3)
    prod = product()
    theta = prod.random_point(generator=g)
    assert max_diff(aggregate(RLAvg, prod, theta, [theta, theta]), theta) < 1e-12
    v = tangent(prod, theta, g, 1.0)
    errors = []
    for s in (0.1, 0.05):
        y = prod.exp(theta, {k: s * t for k, t in v.items()})
        errors.append(max_diff(aggregate(RLAvg, prod, theta, [y, y]), y))
    assert 6 < errors[0] / errors[1] < 10


@pytest.mark.parametrize("scheme", ALL, ids=lambda s: s.name)
def test_euclidean_groups_are_plain_weighted_averages(scheme):
    g = torch.Generator().manual_seed(4)
    prod = ProductManifold({"head": Euclidean(3, 2), "bias": Euclidean(5)})
    theta = prod.random_point(generator=g)
    local = [prod.random_point(generator=g) for _ in range(4)]
    weights = [10.0, 20.0, 30.0, 40.0]
    out = aggregate(scheme, prod, theta, local, weights)
    for k in out:
        expected = sum(w * y[k] for w, y in zip(weights, local)) / sum(weights)
        assert float((out[k] - expected).abs().max()) < 1e-12


def test_weights_are_normalised_and_uniform_by_default():
    g = torch.Generator().manual_seed(5)
    prod = product()
    theta = prod.random_point(generator=g)
    local = clients_near(prod, theta, g, 3, 0.2)
    uniform = aggregate(RetAvg, prod, theta, local)
    assert max_diff(uniform, aggregate(RetAvg, prod, theta, local, [7.0, 7.0, 7.0])) < 1e-12
    assert max_diff(
        aggregate(KFAvg, prod, theta, local, [1.0, 2.0, 0.5]), aggregate(KFAvg, prod, theta, local, [4.0, 8.0, 2.0])
    ) < 1e-12
    assert max_diff(aggregate(ProjAvg, prod, theta, local, [0.0, 1.0, 0.0]), local[1]) < 1e-12


@pytest.mark.parametrize(
    "weights, match",
    [
        ([1.0, 2.0], "one weight per submission"),
        ([1.0, -1.0, 1.0], ">= 0"),
        ([0.0, 0.0, 0.0], "not all 0"),
        ([1.0, float("nan"), 1.0], "finite"),
    ],
)
def test_bad_weights_raise(weights, match):
    prod = product()
    theta = prod.random_point()
    with pytest.raises(ValueError, match=match):
        aggregate(ProjAvg, prod, theta, [theta, theta, theta], weights)


def test_bad_arguments_raise():
    prod = product()
    theta = prod.random_point()
    with pytest.raises(ValueError, match="scheme"):
        submit("projavg", prod, theta, theta)
    with pytest.raises(ValueError, match="at least one"):
        combine(ProjAvg, prod, theta, [])
    partial = {k: v for k, v in theta.items() if k != "head"}
    with pytest.raises(ValueError, match="submissions\\[1\\].*missing \\['head'\\]"):
        combine(ProjAvg, prod, theta, [theta, partial])


def test_registry_matches_config_and_accepts_classes_or_instances():
    assert tuple(SCHEMES) == config.SCHEMES
    assert all(cls.name == name for name, cls in SCHEMES.items())
    g = torch.Generator().manual_seed(6)
    prod = product()
    theta = prod.random_point(generator=g)
    local = clients_near(prod, theta, g, 2, 0.1)
    for cls in ALL:
        assert max_diff(aggregate(cls, prod, theta, local), aggregate(cls(), prod, theta, local)) == 0.0


@pytest.mark.parametrize("scheme", ALL, ids=lambda s: s.name)
def test_submission_is_batched_over_stacked_clients(scheme):
    g = torch.Generator().manual_seed(7)
    prod = product()
    theta = prod.random_point(generator=g)
    local = clients_near(prod, theta, g, 3, 0.2)
    for k, m in prod.groups.items():
        stacked = scheme.submission(m, theta[k], torch.stack([y[k] for y in local]))
        for i, y in enumerate(local):
            assert float((stacked[i] - scheme.submission(m, theta[k], y[k])).abs().max()) < 1e-12
