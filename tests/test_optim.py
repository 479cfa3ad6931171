"""Local optimisers and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfedray import config
from rfedray.geometry import Euclidean, Grassmann, Sphere, Stiefel
from rfedray.optim import (
    OPTIMIZERS,
    RSGD,
    SCHEDULES,
    Adam,
    Constant,
    Cosine,
    SGDMomentum,
    StepDecay,
    build_optimizer,
)

F64 = torch.float64
MANIFOLDS = {
    "stiefel": lambda: Stiefel(6, 3),
    "grassmann": lambda: Grassmann(5, 2),
    "sphere": lambda: Sphere(4),
    "euclidean": lambda: Euclidean(3, 2),
}
BUILDERS = {
    "rsgd": lambda m: RSGD(m, 0.1),
    "sgd": lambda m: SGDMomentum(m, 0.1, momentum=0.9),
    "adam": lambda m: Adam(m, 0.05),
}



def private_gradient(m, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A noisy tangent gradient, as the private step produces."""
    return m.proj_tangent(x, torch.randn(m.shape, generator=g, dtype=x.dtype))


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(sorted(MANIFOLDS)), st.sampled_from(sorted(BUILDERS)), st.integers(0, 2**31 - 1))
def test_iterates_stay_on_the_manifold(manifold, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    m = MANIFOLDS[manifold]()
    opt = BUILDERS[optimizer](m)
    x = m.random_point(generator=g)
    for t in range(30):
        x = opt.step(x, private_gradient(m, x, g), t)
        assert float(m.distance_to_manifold(x)) < 1e-10


def test_rsgd_is_projected_gradient_step():
    g = torch.Generator().manual_seed(0)
    for make in MANIFOLDS.values():
        m = make()
        x = m.random_point(generator=g)
        grad = private_gradient(m, x, g)
        assert torch.equal(RSGD(m, 0.3).step(x, grad, 0), m.project(x - 0.3 * grad))


def test_momentum_buffer_is_projected_onto_the_current_tangent_space():
    g = torch.Generator().manual_seed(1)
    m = Stiefel(6, 3)
    opt = SGDMomentum(m, 0.1, momentum=0.5)
    x0 = m.random_point(generator=g)
    g0 = private_gradient(m, x0, g)
    x1 = opt.step(x0, g0, 0)
    assert torch.equal(x1, m.project(x0 - 0.1 * g0))
    g1 = private_gradient(m, x1, g)
    x2 = opt.step(x1, g1, 1)
    expected = m.project(x1 - 0.1 * (0.5 * m.proj_tangent(x1, g0) + g1))
    assert float((x2 - expected).abs().max()) < 1e-14
    assert float((m.proj_tangent(x1, opt.state["momentum_buffer"]) - opt.state["momentum_buffer"]).abs().max()) < 1e-14


def test_zero_momentum_is_rsgd():
    g = torch.Generator().manual_seed(2)
    m = Grassmann(5, 2)
    a, b = SGDMomentum(m, 0.1, momentum=0.0), RSGD(m, 0.1)
    xa = xb = m.random_point(generator=g)
    for t in range(5):
        grad = private_gradient(m, xa, g)
        xa, xb = a.step(xa, grad, t), b.step(xb, grad, t)
        assert float((xa - xb).abs().max()) < 1e-14


def test_adam_first_step_is_projected_sign_like_step():
    g = torch.Generator().manual_seed(3)
    m = Sphere(5)
    x = m.random_point(generator=g)
    grad = private_gradient(m, x, g)
    new = Adam(m, 0.01, eps=1e-8).step(x, grad, 0)
    u = 0.01 * m.proj_tangent(x, grad / (grad.abs() + 1e-8))
    assert float((new - m.project(x - u)).abs().max()) < 1e-14


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (
            lambda m: SGDMomentum(m, 0.05, momentum=0.8, weight_decay=0.01),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, weight_decay=0.01),
        ),
        (
            lambda m: Adam(m, 0.05, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.01),
            lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01),
        ),
        (lambda m: RSGD(m, 0.05, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.01)),
    ],
)
def test_euclidean_groups_match_torch_optim(ours, theirs):
    g = torch.Generator().manual_seed(4)
    m = Euclidean(4, 3)
    x = m.random_point(generator=g)
    param = torch.nn.Parameter(x.clone())
    opt, ref = ours(m), theirs([param])
    for t in range(6):
        grad = torch.randn(4, 3, generator=g, dtype=F64)
        x = opt.step(x, grad, t)
        param.grad = grad.clone()
        ref.step()
        assert float((x - param.detach()).abs().max()) < 1e-13


def test_weight_decay_vanishes_on_compact_manifolds():
    g = torch.Generator().manual_seed(5)
    for m in (Stiefel(6, 3), Grassmann(5, 2), Sphere(4)):
        x = m.random_point(generator=g)
        grad = private_gradient(m, x, g)
        decayed = RSGD(m, 0.1, weight_decay=0.5).step(x, grad, 0)
        assert float((decayed - RSGD(m, 0.1).step(x, grad, 0)).abs().max()) < 1e-14


def test_schedules_give_the_right_multipliers():
    assert [Constant()(t) for t in (0, 1, 1000)] == [1.0, 1.0, 1.0]
    decay = StepDecay(step_size=10, gamma=0.5)
    assert [decay(t) for t in (0, 9, 10, 19, 20, 35)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]
    cosine = Cosine(total_steps=100)
    assert cosine(0) == 1.0
    assert cosine(50) == pytest.approx(0.5, abs=1e-15)
    assert cosine(25) == pytest.approx((1 + math.cos(math.pi / 4)) / 2, abs=1e-15)
    assert cosine(100) == pytest.approx(0.0, abs=1e-15)
    assert cosine(250) == pytest.approx(0.0, abs=1e-15)


def test_step_uses_the_scheduled_learning_rate():
    g = torch.Generator().manual_seed(6)
    m = Stiefel(5, 2)
    opt = RSGD(m, 0.4, schedule=StepDecay(step_size=3, gamma=0.25))
    x = m.random_point(generator=g)
    grad = private_gradient(m, x, g)
    assert torch.equal(opt.step(x, grad, 7), m.project(x - 0.4 * 0.0625 * grad))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_state_round_trips_through_state_dict(name):
    g = torch.Generator().manual_seed(7)
    m = Stiefel(6, 3)
    a = BUILDERS[name](m)
    x = m.random_point(generator=g)
    for t in range(3):
        x = a.step(x, private_gradient(m, x, g), t)
    saved = a.state_dict()
    b = BUILDERS[name](m)
    b.load_state_dict(saved)
    xa = xb = x
    for t in range(3, 6):
        grad = private_gradient(m, xa, g)
        xa, xb = a.step(xa, grad, t), b.step(xb, grad, t)
    assert torch.equal(xa, xb)
    assert all(torch.is_tensor(v) for v in saved["state"].values())
    if saved["state"]:
        key = next(iter(saved["state"]))
        assert not torch.equal(saved["state"][key], a.state[key])


def test_load_state_dict_of_another_optimizer_raises():
    m = Sphere(3)
    with pytest.raises(ValueError, match="this optimiser is Adam"):
        Adam(m, 0.1).load_state_dict(SGDMomentum(m, 0.1).state_dict())


def test_loading_an_empty_state_resets_the_optimizer():
    g = torch.Generator().manual_seed(8)
    m = Sphere(4)
    opt = Adam(m, 0.1)
    x = m.random_point(generator=g)
    opt.step(x, private_gradient(m, x, g), 0)
    opt.load_state_dict({})
    assert opt.state == {}
    grad = private_gradient(m, x, g)
    assert torch.equal(opt.step(x, grad, 0), Adam(m, 0.1).step(x, grad, 0))


@pytest.mark.parametrize("name", config.OPTIMIZERS)
@pytest.mark.parametrize("schedule", config.SCHEDULES)
def test_build_optimizer_from_config(name, schedule):
    cfg = config.OptimizerConfig(
        name=name, lr=0.3, momentum=0.7, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.01,
        schedule=schedule, step_size=4, gamma=0.5,
    )
    opt = build_optimizer(cfg, Stiefel(5, 2), total_steps=40)
    assert isinstance(opt, OPTIMIZERS[name]) and isinstance(opt.schedule, SCHEDULES[schedule])
    assert (opt.lr, opt.weight_decay) == (0.3, 0.01)
    if name == "sgd":
        assert opt.momentum == 0.7
    if name == "adam":
        assert (opt.beta1, opt.beta2, opt.eps) == (0.8, 0.95, 1e-7)
    expected = {"constant": 1.0, "step": 0.25, "cosine": 0.5 * (1 + math.cos(math.pi * 8 / 40))}
    assert opt.schedule(8) == expected[schedule]


def test_registries_match_config():
    assert tuple(OPTIMIZERS) == config.OPTIMIZERS
    assert tuple(SCHEDULES) == config.SCHEDULES


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: RSGD(Sphere(3), 0.0), "lr"),
        (lambda: RSGD(Sphere(3), float("inf")), "lr"),
        (lambda: RSGD(Sphere(3), 0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: RSGD(Sphere(3), 0.1, schedule="cosine"), "schedule"),
        (lambda: RSGD("sphere", 0.1), "manifold"),
        (lambda: SGDMomentum(Sphere(3), 0.1, momentum=1.0), "momentum"),
        (lambda: Adam(Sphere(3), 0.1, beta1=-0.1), "beta1"),
        (lambda: Adam(Sphere(3), 0.1, beta2=1.0), "beta2"),
        (lambda: Adam(Sphere(3), 0.1, eps=0.0), "eps"),
        (lambda: StepDecay(0, 0.5), "step_size"),
        (lambda: StepDecay(10, 0.0), "gamma"),
        (lambda: Cosine(0), "total_steps"),
        (lambda: Constant()(-1), "step_index"),
        (lambda: build_optimizer(config.OptimizerConfig(name="lbfgs"), Sphere(3), 10), "name"),
        (lambda: build_optimizer(config.OptimizerConfig(), Sphere(3), 0), "total_steps"),
    ],
)
def test_bad_arguments_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()
