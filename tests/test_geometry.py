"""Properties of the manifolds: projections, retractions, exponential and logarithm maps."""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfedray.geometry import (
    STIEFEL_RETRACTIONS,
    Euclidean,
    Grassmann,
    Manifold,
    NotConvergedError,
    PolarRetraction,
    ProductManifold,
    QRRetraction,
    Sphere,
    Stiefel,
)
from rfedray.geometry.base import qr_solve

TOL = 1e-10
F64 = torch.float64



@st.composite
def manifolds(draw, curved_only: bool = False) -> Manifold:
    kinds = ["sphere", "stiefel", "grassmann"] + ([] if curved_only else ["euclidean"])
    kind = draw(st.sampled_from(kinds))
    if kind == "euclidean":
        return Euclidean(*draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    if kind == "sphere":
        return Sphere(draw(st.integers(2, 6)))
    if kind == "stiefel":
        d = draw(st.integers(1, 7))
        p = draw(st.integers(1, d))
        return Stiefel(d, p, retraction=STIEFEL_RETRACTIONS[draw(st.sampled_from(["polar", "qr"]))])
    d = draw(st.integers(2, 7))
    return Grassmann(d, draw(st.integers(1, d - 1)))


seeds = st.integers(0, 2**31 - 1)
fast = settings(max_examples=25, deadline=None)


def ambient(m: Manifold, g: torch.Generator, *batch: int, dtype=F64) -> torch.Tensor:
    return torch.randn(*batch, *m.shape, generator=g, dtype=dtype)


def tangent(m: Manifold, x: torch.Tensor, g: torch.Generator, scale: float, *batch: int) -> torch.Tensor:
    """A random tangent vector at ``x`` of Frobenius norm ``scale`` (zero if the tangent space is)."""
    v = m.proj_tangent(x, ambient(m, g, *batch, dtype=x.dtype))
    n = m.norm(v)
    return v * torch.where(n > 0, scale / n.clamp_min(1e-300), 0.0).reshape(*n.shape, *[1] * len(m.shape))


def dot(a: torch.Tensor, b: torch.Tensor, m: Manifold) -> torch.Tensor:
    return (a * b).flatten(-len(m.shape)).sum(-1)


def on_manifold_residual(m: Manifold, x: torch.Tensor) -> float:
    """The defining equations of ``m`` evaluated at ``x`` (0 on the manifold)."""
    if isinstance(m, Sphere):
        return float((x.norm(dim=-1) - 1).abs().max())
    if isinstance(m, Stiefel):
        return float((x.mT @ x - torch.eye(m.p, dtype=x.dtype)).abs().max())
    if isinstance(m, Grassmann):
        trace = torch.diagonal(x, dim1=-2, dim2=-1).sum(-1)
        return float(max((x @ x - x).abs().max(), (x - x.mT).abs().max(), (trace - m.p).abs().max()))
    return 0.0



@fast
@given(manifolds(), seeds)
def test_project_lands_on_manifold_and_is_idempotent(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = m.project(ambient(m, g, 3))
    assert on_manifold_residual(m, x) < TOL
    assert float((m.project(x) - x).abs().max()) < TOL
    assert float(m.distance_to_manifold(x).max()) < TOL


@fast
@given(manifolds(), seeds)
def test_project_is_the_nearest_point(m, seed):
    g = torch.Generator().manual_seed(seed)
    y = ambient(m, g)
    x = m.project(y)
    others = m.random_point(200, generator=g)
    assert float(m.distance_to_manifold(y)) <= float(m.norm(y - others).min()) + TOL
    assert float(m.distance_to_manifold(y)) == pytest.approx(float(m.norm(y - x)), abs=TOL)


@fast
@given(st.integers(1, 8).flatmap(lambda d: st.tuples(st.just(d), st.integers(1, d))), seeds)
def test_stiefel_projection_is_scipy_polar_factor(dp, seed):
    d, p = dp
    y = torch.randn(d, p, generator=torch.Generator().manual_seed(seed), dtype=F64)
    u, _ = scipy.linalg.polar(y.numpy(), side="right")
    np.testing.assert_allclose(Stiefel(d, p).project(y).numpy(), u, atol=TOL)


@fast
@given(st.integers(2, 8).flatmap(lambda d: st.tuples(st.just(d), st.integers(1, d - 1))), seeds)
def test_grassmann_projection_is_top_eigenspace(dp, seed):
    d, p = dp
    y = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=F64)
    _, vecs = np.linalg.eigh((y + y.T).numpy() / 2)
    top = vecs[:, -p:]
    np.testing.assert_allclose(Grassmann(d, p).project(y).numpy(), top @ top.T, atol=TOL)


@fast
@given(st.integers(12, 64).flatmap(lambda d: st.tuples(st.just(d), st.integers(1, (d - 8) // 4))), seeds,
       st.sampled_from([1e-4, 0.1, 1.0, 10.0]))
def test_grassmann_project_step_is_the_top_eigenspace_of_x_plus_v(dp, seed, scale):
    """The sketched Rayleigh-Ritz step equals numpy's top eigenspace of X + V for steps from tiny to
    far larger than the manifold (2p + 4 <= d / 2: the sketched branch)."""
    d, p = dp
    m = Grassmann(d, p)
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    v = scale * m.proj_tangent(x, torch.randn(d, d, generator=g, dtype=F64))
    _, vecs = np.linalg.eigh((x + v).numpy())
    top = vecs[:, -p:]
    np.testing.assert_allclose(m.project_step(x, v).numpy(), top @ top.T, atol=1e-10)


@pytest.mark.parametrize("d, p", [(40, 4), (40, 8), (26, 8), (10, 1)])
def test_grassmann_project_step_in_float32_batched_and_its_fallbacks(d, p):
    """Batches and float32 points (the local step's) agree with Pi(x + v) to float32 rounding; where
    the sketch is not smaller than d / 2, or a gradient flows, it is Pi(x + v) itself."""
    m = Grassmann(d, p)
    g = torch.Generator().manual_seed(d + p)
    x = m.random_point(6, generator=g)
    v = m.proj_tangent(x, 0.2 * torch.randn(6, d, d, generator=g, dtype=F64))
    x32, v32 = x.float(), v.float()
    step = m.project_step(x32, v32)
    assert step.dtype == torch.float32 and step.shape == (6, d, d)
    torch.testing.assert_close(step, m.project(x32 + v32), rtol=0, atol=2e-7)
    torch.testing.assert_close(step @ step, step, rtol=0, atol=5e-7)
    if 2 * (2 * p + 4) > d:
        assert torch.equal(step, m.project(x32 + v32))
    live = v.clone().requires_grad_(True)
    out = m.project_step(x, live)
    (grad,) = torch.autograd.grad(out.sum(), live)
    assert torch.isfinite(grad).all()


def tangent_matrix(m: Manifold, x: torch.Tensor) -> torch.Tensor:
    """The matrix of ``P_x`` acting on the flattened ambient space."""
    n = int(np.prod(m.shape))
    basis = torch.eye(n, dtype=x.dtype).reshape(n, *m.shape)
    return m.proj_tangent(x, basis).reshape(n, n).T


@fast
@given(manifolds(), seeds)
def test_proj_tangent_is_an_orthogonal_projection_of_rank_dim(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    z1, z2 = ambient(m, g), ambient(m, g)
    p1 = m.proj_tangent(x, z1)
    assert float((m.proj_tangent(x, p1) - p1).abs().max()) < TOL
    assert float(dot(p1, z2, m)) == pytest.approx(float(dot(z1, m.proj_tangent(x, z2), m)), abs=TOL)
    mat = tangent_matrix(m, x)
    assert float((mat - mat.T).abs().max()) < TOL
    assert float((mat @ mat - mat).abs().max()) < TOL
    assert int(torch.linalg.matrix_rank(mat, atol=1e-6)) == m.dim
    assert float(torch.trace(mat)) == pytest.approx(m.dim, abs=TOL)


@fast
@given(manifolds(), seeds)
def test_proj_tangent_image_is_tangent(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    v = m.proj_tangent(x, ambient(m, g))
    if isinstance(m, Sphere):
        assert float((x * v).sum().abs()) < TOL
    if isinstance(m, Stiefel):
        assert float((x.mT @ v + v.mT @ x).abs().max()) < TOL
    if isinstance(m, Grassmann):
        assert float((v - v.mT).abs().max()) < TOL
        assert float((x @ v + v @ x - v).abs().max()) < TOL
    t = 1e-4
    assert float(m.distance_to_manifold(x + t * v)) < 10 * t**2 * (1 + float(m.norm(v)) ** 2)


@fast
@given(manifolds(), seeds)
def test_derivative_of_projection_is_proj_tangent(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    z = ambient(m, g)
    h = 1e-6
    fd = (m.project(x + h * z) - m.project(x - h * z)) / (2 * h)
    assert float((fd - m.proj_tangent(x, z)).abs().max()) < 1e-7
    _, jvp = torch.func.jvp(m.project, (x,), (z,))
    assert float((jvp - m.proj_tangent(x, z)).abs().max()) < TOL
    jac = torch.autograd.functional.jacobian(m.project, x).reshape(tangent_matrix(m, x).shape)
    assert float((jac - tangent_matrix(m, x)).abs().max()) < TOL


def test_proj_tangent_broadcasts_over_per_sample_gradients():
    g = torch.Generator().manual_seed(0)
    for m in (Stiefel(6, 3), Grassmann(5, 2), Sphere(4), Euclidean(3, 2)):
        x = m.random_point(generator=g)
        z = ambient(m, g, 7)
        batched = m.proj_tangent(x, z)
        assert batched.shape == (7, *m.shape)
        assert float((batched[3] - m.proj_tangent(x, z[3])).abs().max()) < TOL


def test_project_and_proj_tangent_under_vmap_and_grad():
    g = torch.Generator().manual_seed(1)
    for m in (Stiefel(6, 3), Grassmann(5, 2), Sphere(4), Euclidean(3, 2)):
        x = m.random_point(generator=g)
        z = ambient(m, g, 5)
        assert float((torch.func.vmap(m.project)(z) - m.project(z)).abs().max()) < TOL
        vm = torch.func.vmap(m.proj_tangent, in_dims=(None, 0))(x, z)
        assert float((vm - m.proj_tangent(x, z)).abs().max()) < TOL

        def loss(y):
            return (m.project(y) * x).sum()

        grads = torch.func.vmap(torch.func.grad(loss))(m.project(z))
        loop = torch.stack([torch.func.grad(loss)(m.project(zi)) for zi in z])
        assert bool(torch.isfinite(grads).all())
        assert float((grads - loop).abs().max()) < TOL



@fast
@given(manifolds(), seeds, st.floats(0.0, 0.5))
def test_inv_retract_inverts_retract(m, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    v = tangent(m, x, g, scale, 3)
    y = m.retract(x, v)
    assert on_manifold_residual(m, y) < TOL
    assert float((m.inv_retract(x, y) - v).abs().max()) < TOL
    assert float((m.retract(x, m.inv_retract(x, y)) - y).abs().max()) < TOL


@fast
@given(manifolds(), seeds, st.floats(0.0, 0.8))
def test_log_inverts_exp(m, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    v = tangent(m, x, g, scale, 3)
    y = m.exp(x, v)
    assert on_manifold_residual(m, y) < TOL
    assert float((m.log(x, y) - v).abs().max()) < TOL


@fast
@given(manifolds(curved_only=True), seeds, st.floats(0.05, 1.0), st.floats(0.0, 1.0))
def test_exp_solves_the_geodesic_equation(m, seed, speed, t):
    """``gamma(t) = Exp_x(t v)``: the acceleration is normal to ``T_gamma`` and the speed constant."""
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(generator=g)
    v = tangent(m, x, g, speed)
    h = 1e-4

    def gamma(s: float) -> torch.Tensor:
        return m.exp(x, s * v)

    accel = (gamma(t + h) - 2 * gamma(t) + gamma(t - h)) / h**2
    vel = (gamma(t + h) - gamma(t - h)) / (2 * h)
    assert float(m.norm(m.proj_tangent(gamma(t), accel))) < 1e-5
    assert float(m.norm(vel)) == pytest.approx(float(m.norm(v)), abs=1e-7)


def test_stiefel_exp_at_zero_and_first_order():
    g = torch.Generator().manual_seed(2)
    m = Stiefel(7, 3)
    x = m.random_point(generator=g)
    v = tangent(m, x, g, 1.0)
    assert float((m.exp(x, 0 * v) - x).abs().max()) < TOL
    h = 1e-6
    assert float(((m.exp(x, h * v) - m.exp(x, -h * v)) / (2 * h) - v).abs().max()) < 1e-8


def test_grassmann_exp_matches_principal_angle_formula():
    """``Exp_X(V) = span(U Z cos(S) + Q sin(S))`` for the thin SVD ``Q S Z^T`` of ``B = V U``."""
    g = torch.Generator().manual_seed(3)
    m = Grassmann(9, 3)
    x = m.random_point(generator=g)
    v = tangent(m, x, g, 1.3)
    u = torch.linalg.eigh(x)[1][:, -3:]
    q, s, zh = torch.linalg.svd(v @ u, full_matrices=False)
    y = u @ zh.mT * torch.cos(s) + q * torch.sin(s)
    assert float((m.exp(x, v) - y @ y.mT).abs().max()) < TOL


def test_polar_inverse_solves_scipy_lyapunov():
    g = torch.Generator().manual_seed(4)
    m = Stiefel(9, 4)
    x = m.random_point(generator=g)
    y = m.retract(x, tangent(m, x, g, 0.7))
    a = (x.T @ y).numpy()
    s = scipy.linalg.solve_continuous_lyapunov(a, 2 * np.eye(4))
    np.testing.assert_allclose(m.inv_retract(x, y).numpy(), y.numpy() @ s - x.numpy(), atol=TOL)


@pytest.mark.parametrize("retraction", [PolarRetraction, QRRetraction])
def test_inverse_retractions_at_sizes_where_batched_lu_is_broken(retraction):
    """p >= 151 with a batch on two threads: torch's batched CPU LU is wrong there (pytorch issue
    142815); ours uses QR and triangular solves."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(5)
    m = Stiefel(160, 155, retraction=retraction)
    x = m.random_point(generator=g)
    v = tangent(m, x, g, 0.5, 2)
    assert float((m.inv_retract(x, m.retract(x, v)) - v).abs().max()) < 1e-9
    a = torch.randn(3, 160, 160, generator=g, dtype=F64) + 20 * torch.eye(160, dtype=F64)
    b = torch.randn(3, 160, 2, generator=g, dtype=F64)
    assert float((a @ qr_solve(a, b) - b).abs().max()) < 1e-10
    torch.set_num_threads(1)


def test_outside_the_image_of_a_retraction_raises():
    g = torch.Generator().manual_seed(6)
    for m in (Stiefel(5, 2, retraction=PolarRetraction), Stiefel(5, 2, retraction=QRRetraction), Sphere(3)):
        x = m.random_point(generator=g)
        with pytest.raises(ValueError, match="image"):
            m.inv_retract(x, -x)
    m = Grassmann(4, 1)
    e = torch.eye(4, dtype=F64)
    with pytest.raises(ValueError, match="image"):
        m.inv_retract(e[:, :1] @ e[:1, :], e[:, 1:2] @ e[1:2, :])


def test_stiefel_log_raises_when_it_does_not_converge():
    g = torch.Generator().manual_seed(7)
    m = Stiefel(6, 3, log_max_iter=1)
    x = m.random_point(generator=g)
    with pytest.raises(NotConvergedError, match="did not converge"):
        m.log(x, m.exp(x, tangent(m, x, g, 1.0)))



@settings(max_examples=15, deadline=None)
@given(manifolds(), seeds)
def test_float32(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = m.random_point(2, generator=g, dtype=torch.float32)
    v = tangent(m, x, g, 0.3, 2)
    for y in (m.project(x + v), m.retract(x, v), m.exp(x, v)):
        assert y.dtype == torch.float32
        assert on_manifold_residual(m, y.double()) < 1e-6
    assert float((m.inv_retract(x, m.retract(x, v)) - v).abs().max()) < 1e-4
    assert float((m.log(x, m.exp(x, v)) - v).abs().max()) < 1e-4



def spdnet_product() -> ProductManifold:
    return ProductManifold({"bimap": Stiefel(6, 3), "head": Euclidean(6, 2), "pca": Grassmann(5, 2), "dir": Sphere(3)})


def test_product_manifold_is_group_wise():
    g = torch.Generator().manual_seed(8)
    prod = spdnet_product()
    assert prod.dim == 6 * 3 - 6 + 12 + 6 + 2
    assert prod.ambient_dim == 18 + 12 + 15 + 3
    x = prod.random_point(generator=g)
    z = {k: ambient(m, g, 4) for k, m in prod.groups.items()}
    v = {k: 0.1 * t[0] for k, t in prod.proj_tangent(x, z).items()}
    for name, m in prod.groups.items():
        assert torch.equal(prod.project(z)[name], m.project(z[name]))
        assert torch.equal(prod.proj_tangent(x, z)[name], m.proj_tangent(x[name], z[name]))
        assert torch.equal(prod.retract(x, v)[name], m.retract(x[name], v[name]))
        assert torch.equal(prod.exp(x, v)[name], m.exp(x[name], v[name]))
        y = prod.retract(x, v)
        assert torch.equal(prod.inv_retract(x, y)[name], m.inv_retract(x[name], y[name]))
        assert torch.equal(prod.log(x, y)[name], m.log(x[name], y[name]))
        assert torch.equal(prod.distance_to_manifold(z)[name], m.distance_to_manifold(z[name]))


def test_product_norm_is_joint_and_batched():
    g = torch.Generator().manual_seed(9)
    prod = spdnet_product()
    z = {k: ambient(m, g, 4) for k, m in prod.groups.items()}
    norms = prod.norm(z)
    assert norms.shape == (4,)
    flat = torch.cat([t.flatten(1) for t in z.values()], 1)
    assert float((norms - flat.norm(dim=1)).abs().max()) < TOL


def test_product_checks_group_names():
    prod = spdnet_product()
    x = prod.random_point()
    del x["head"]
    with pytest.raises(ValueError, match="missing \\['head'\\]"):
        prod.project(x)
    with pytest.raises(ValueError, match="at least one group"):
        ProductManifold({})



@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Stiefel(3, 4), "1 <= p <= d"),
        (lambda: Stiefel(3, 0), "1 <= p <= d"),
        (lambda: Stiefel(3, 2, retraction="polar"), "retraction"),
        (lambda: Stiefel(3, 2, log_max_iter=0), "log_max_iter"),
        (lambda: Grassmann(3, 3), "1 <= p < d"),
        (lambda: Sphere(1), "n >= 2"),
        (lambda: Euclidean(), "Euclidean"),
        (lambda: Euclidean(3, 0), "Euclidean"),
        (lambda: Stiefel(4, 2).project(torch.zeros(2, 4)), r"needs \(\.\.\., 4, 2\)"),
        (lambda: Grassmann(4, 2).proj_tangent(torch.eye(4), torch.zeros(3)), "needs"),
    ],
)
def test_bad_arguments_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_stiefel_accepts_retraction_class_or_instance():
    assert isinstance(Stiefel(4, 2, retraction=QRRetraction).retraction, QRRetraction)
    assert isinstance(Stiefel(4, 2, retraction=QRRetraction()).retraction, QRRetraction)
    assert isinstance(Stiefel(4, 2).retraction, PolarRetraction)



def test_geoopt_euclidean_stiefel_proju_is_our_proj_tangent():
    g = torch.Generator().manual_seed(10)
    m = Stiefel(8, 3)
    x = m.random_point(generator=g)
    z = ambient(m, g, 5)
    ours = m.proj_tangent(x, z)
    theirs = geoopt.manifolds.EuclideanStiefel().proju(x.expand_as(z), z)
    assert float((ours - theirs).abs().max()) < TOL


def test_geoopt_canonical_stiefel_proju_is_not_an_orthogonal_projection():
    """Why geoopt's default Stiefel (CanonicalStiefel) must not be used for clipping or noise: its
    ``proju(x, u) = u - x u^T x`` is not idempotent (not a projection at all) and doubles the
    ``X Omega`` (skew) directions, so clipping its output would not bound the tangent gradient."""
    g = torch.Generator().manual_seed(11)
    m = Stiefel(8, 3)
    x = m.random_point(generator=g)
    u = torch.randn(8, 3, generator=g, dtype=F64)
    canonical = geoopt.manifolds.CanonicalStiefel()
    pu = canonical.proju(x, u)
    assert float((canonical.proju(x, pu) - pu).abs().max()) > 1e-3
    omega = torch.tensor([[0.0, 1.0, -2.0], [-1.0, 0.0, 0.5], [2.0, -0.5, 0.0]], dtype=F64)
    assert float((canonical.proju(x, x @ omega) - 2 * x @ omega).abs().max()) < TOL
    assert float((m.proj_tangent(x, x @ omega) - x @ omega).abs().max()) < TOL


@pytest.mark.parametrize("dtype, norm, tol", [(F64, 0.03, 1e-14), (torch.float32, 0.5, 1e-6)])
def test_matrix_exp_of_a_single_matrix_is_accurate(dtype, norm, tol):
    """Regression for pytorch issue 196592 (wrong degree-8 Taylor coefficient for lone matrices)."""
    from rfedray.geometry.base import matrix_exp

    a = torch.tensor([[0.0, -norm], [norm, 0.0]], dtype=dtype)
    rotation = torch.tensor([[np.cos(norm), -np.sin(norm)], [np.sin(norm), np.cos(norm)]], dtype=F64)
    assert float((matrix_exp(a).double() - rotation).abs().max()) < tol
    assert float((matrix_exp(a[None]).double() - rotation).abs().max()) < tol
