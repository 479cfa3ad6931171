"""Spectral functions of symmetric matrices: values, the Daleckii-Krein backward, ties, vmap."""

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

from rfedray.spectral import (
    Clamp,
    ClampedLog,
    InvSqrt,
    Log,
    Sqrt,
    spectral_map,
    sym_clamp,
    sym_clamped_log,
    sym_inv_sqrt,
    sym_log,
    sym_sqrt,
)


FUNCTIONS = {
    "log": (Log(), np.log),
    "sqrt": (Sqrt(), np.sqrt),
    "inv_sqrt": (InvSqrt(), lambda v: 1.0 / np.sqrt(v)),
    "clamp": (Clamp(0.5), lambda v: np.maximum(v, 0.5)),
    "clamped_log": (ClampedLog(0.5), lambda v: np.log(np.maximum(v, 0.5))),
}
SCIPY_ANALYTIC = {
    "log": scipy.linalg.logm,
    "sqrt": scipy.linalg.sqrtm,
    "inv_sqrt": lambda a: np.linalg.inv(scipy.linalg.sqrtm(a)),
}


def spd_with_spectrum(eigvals, generator, dtype=torch.float64):
    """``Q diag(eigvals) Q^T`` with a random orthogonal ``Q``; eigvals of shape (..., n)."""
    eigvals = torch.as_tensor(eigvals, dtype=torch.float64)
    n = eigvals.shape[-1]
    q, _ = torch.linalg.qr(torch.randn(*eigvals.shape[:-1], n, n, generator=generator, dtype=torch.float64))
    x = (q * eigvals.unsqueeze(-2)) @ q.transpose(-1, -2)
    return (0.5 * (x + x.transpose(-1, -2))).to(dtype)


def random_sym(shape, generator, dtype=torch.float64):
    a = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return (0.5 * (a + a.transpose(-1, -2))).to(dtype)


def eigh_autograd(x, fn):
    """Reference: the same map differentiated by plain autograd through eigh."""
    l, u = torch.linalg.eigh(x)
    return (u * fn.value(l).unsqueeze(-2)) @ u.transpose(-1, -2)


def frechet_block(f, x, e):
    """Independent reference: ``f([[X, E], [0, X]])`` has ``Df(X)[E]`` as its upper-right block."""
    n = x.shape[0]
    block = np.zeros((2 * n, 2 * n))
    block[:n, :n] = x
    block[n:, n:] = x
    block[:n, n:] = e
    return np.real(f(block))[:n, n:]


def central_difference(fn, x, direction, h):
    return (spectral_map(x + h * direction, fn) - spectral_map(x - h * direction, fn)) / (2 * h)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_forward_matches_eigendecomposition(name):
    g = torch.Generator().manual_seed(1)
    fn, ref = FUNCTIONS[name]
    spectrum = torch.tensor([[0.1, 0.3, 0.7, 1.5, 4.0], [0.2, 0.2, 0.9, 2.0, 2.0]])
    x = spd_with_spectrum(spectrum, g)
    out = spectral_map(x, fn)
    for xi, oi in zip(x.numpy(), out.numpy()):
        l, u = np.linalg.eigh(xi)
        np.testing.assert_allclose(oi, (u * ref(l)) @ u.T, atol=1e-12)


@pytest.mark.parametrize("name", sorted(SCIPY_ANALYTIC))
def test_forward_matches_scipy(name):
    g = torch.Generator().manual_seed(2)
    x = spd_with_spectrum(torch.logspace(-3, 1, 6), g)
    fn, _ = FUNCTIONS[name]
    np.testing.assert_allclose(spectral_map(x, fn).numpy(), np.real(SCIPY_ANALYTIC[name](x.numpy())), atol=1e-9)


def test_named_wrappers():
    g = torch.Generator().manual_seed(3)
    x = spd_with_spectrum(torch.tensor([1e-4, 0.01, 0.5, 2.0]), g)
    torch.testing.assert_close(sym_log(x), torch.as_tensor(np.real(scipy.linalg.logm(x.numpy()))))
    torch.testing.assert_close(sym_sqrt(x) @ sym_sqrt(x), x)
    torch.testing.assert_close(sym_inv_sqrt(x) @ x @ sym_inv_sqrt(x), torch.eye(4, dtype=x.dtype))
    clamped = sym_clamp(x, 0.05)
    torch.testing.assert_close(torch.linalg.eigvalsh(clamped), torch.tensor([0.05, 0.05, 0.5, 2.0], dtype=x.dtype))
    torch.testing.assert_close(sym_clamped_log(x, 0.05), sym_log(clamped))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_backward_matches_eigh_autograd_for_distinct_eigenvalues(name):
    g = torch.Generator().manual_seed(4)
    fn, _ = FUNCTIONS[name]
    x = spd_with_spectrum(torch.tensor([[0.1, 0.3, 0.7, 1.5, 4.0], [0.05, 0.45, 0.8, 1.1, 3.0]]), g)
    weight = torch.randn(x.shape, generator=g, dtype=x.dtype)
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    (spectral_map(x1, fn) * weight).sum().backward()
    (eigh_autograd(x2, fn) * weight).sum().backward()
    ref = 0.5 * (x2.grad + x2.grad.transpose(-1, -2))
    torch.testing.assert_close(x1.grad, ref, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_gradcheck(name):
    g = torch.Generator().manual_seed(5)
    fn, _ = FUNCTIONS[name]
    x = spd_with_spectrum(torch.tensor([0.2, 0.35, 0.9, 2.5]), g).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: spectral_map(a, fn), (x,))


@pytest.mark.parametrize("name", sorted(SCIPY_ANALYTIC))
@pytest.mark.parametrize("spectrum", [[0.3, 0.8, 1.7, 2.9], [1.0, 1.0, 1.0, 2.0], [0.5, 0.5 + 1e-9, 3.0, 3.0]])
def test_backward_matches_frechet_derivative(name, spectrum):
    """Against scipy's logm/sqrtm of a block matrix, an independent reference valid at ties."""
    g = torch.Generator().manual_seed(6)
    fn, _ = FUNCTIONS[name]
    x = spd_with_spectrum(torch.tensor(spectrum), g).requires_grad_(True)
    weight = random_sym((4, 4), g)
    (spectral_map(x, fn) * weight).sum().backward()
    assert torch.isfinite(x.grad).all()
    # <grad, E> = <W, Df(X)[E]> and Df(X) is self-adjoint, so grad = Df(X)[W].
    ref = frechet_block(SCIPY_ANALYTIC[name], x.detach().numpy(), weight.numpy())
    np.testing.assert_allclose(x.grad.numpy(), ref, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("fn", [Clamp(0.5), ClampedLog(0.5)], ids=["clamp", "clamped_log"])
def test_backward_finite_and_correct_when_clamped(fn):
    """Three eigenvalues below the floor become a triple tie; compare to central differences."""
    g = torch.Generator().manual_seed(7)
    x = spd_with_spectrum(torch.tensor([0.01, 0.1, 0.3, 1.0, 2.0]), g).requires_grad_(True)
    weight = random_sym((5, 5), g)
    (spectral_map(x, fn) * weight).sum().backward()
    assert torch.isfinite(x.grad).all()
    for _ in range(3):
        direction = random_sym((5, 5), g)
        fd = (central_difference(fn, x.detach(), direction, 1e-6) * weight).sum()
        torch.testing.assert_close((x.grad * direction).sum(), fd, atol=1e-7, rtol=1e-6)


def test_eigh_autograd_fails_where_spectral_map_does_not():
    """The motivating case: ReEig output has an exactly repeated eigenvalue."""
    g = torch.Generator().manual_seed(8)
    x = spd_with_spectrum(torch.tensor([0.01, 0.1, 1.0, 2.0]), g)
    clamped = sym_clamp(x, 0.5).detach()
    a = clamped.clone().requires_grad_(True)
    b = clamped.clone().requires_grad_(True)
    weight = random_sym((4, 4), g)
    (sym_log(a) * weight).sum().backward()
    (eigh_autograd(b, Log()) * weight).sum().backward()
    assert torch.isfinite(a.grad).all()
    ref = frechet_block(scipy.linalg.logm, clamped.numpy(), weight.numpy())
    np.testing.assert_allclose(a.grad.numpy(), ref, atol=1e-8)
    assert not torch.allclose(b.grad, a.grad, atol=1e-3)


@pytest.mark.filterwarnings("ignore:logm result may be inaccurate")
@settings(max_examples=25, deadline=None)
@given(
    base=st.lists(st.floats(0.05, 5.0), min_size=2, max_size=5),
    repeats=st.lists(st.integers(1, 3), min_size=5, max_size=5),
    jitter=st.sampled_from([0.0, 1e-12, 1e-8, 1e-6, 1e-3]),
)
def test_log_backward_near_ties_property(base, repeats, jitter):
    """Repeated and nearly repeated spectra: finite, matching the block-matrix reference."""
    spectrum = [v * (1 + jitter * k) for v, r in zip(base, repeats) for k in range(r)]
    g = torch.Generator().manual_seed(len(spectrum))
    x = spd_with_spectrum(torch.tensor(spectrum), g).requires_grad_(True)
    n = len(spectrum)
    weight = random_sym((n, n), g)
    (sym_log(x) * weight).sum().backward()
    assert torch.isfinite(x.grad).all()
    ref = frechet_block(scipy.linalg.logm, x.detach().numpy(), weight.numpy())
    np.testing.assert_allclose(x.grad.numpy(), ref, atol=1e-6 * np.abs(ref).max() + 1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [ClampedLog(0.3), Log(), Clamp(0.3), InvSqrt()], ids=["clamped_log", "log", "clamp", "inv_sqrt"])
def test_vmap_grad_equals_per_sample_loop(dtype, fn):
    g = torch.Generator().manual_seed(9)
    spectra = torch.tensor([[0.1, 0.2, 0.6, 1.0, 3.0], [0.05, 0.05, 0.05, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]] * 3)
    x = spd_with_spectrum(spectra, g, dtype)
    weight = random_sym((len(spectra), 5, 5), g, dtype)

    def loss(xi, wi):
        return (spectral_map(xi, fn) * wi).sum()

    batched = vmap(grad(loss))(x, weight)
    loop = torch.stack([grad(loss)(xi, wi) for xi, wi in zip(x, weight)])
    assert batched.dtype == dtype and torch.isfinite(batched).all()
    # Batched and single eigh may pick different bases of a repeated eigenspace; the gradient does
    # not depend on that choice, up to rounding amplified by 1 / min(eigenvalue).
    tol = dict(atol=1e-4 * float(loop.abs().max()), rtol=0) if dtype == torch.float32 else {}
    torch.testing.assert_close(batched, loop, **tol)
    summed = grad(lambda a: vmap(loss)(a, weight).sum())(x)
    torch.testing.assert_close(summed, loop, **tol)


@pytest.mark.parametrize("fn", [ClampedLog(1e-3), Log(), Sqrt()], ids=["clamped_log", "log", "sqrt"])
def test_float32_backward_agrees_with_float64(fn):
    g = torch.Generator().manual_seed(10)
    x64 = spd_with_spectrum(torch.tensor([1e-4, 0.02, 0.02 * (1 + 1e-6), 0.4, 1.3, 1.3]), g).requires_grad_(True)
    x32 = x64.detach().float().requires_grad_(True)
    weight = random_sym((6, 6), g)
    (spectral_map(x64, fn) * weight).sum().backward()
    (spectral_map(x32, fn) * weight.float()).sum().backward()
    assert torch.isfinite(x32.grad).all()
    scale = x64.grad.abs().max()
    torch.testing.assert_close(x32.grad.double() / scale, x64.grad / scale, atol=2e-3, rtol=0)


@pytest.mark.parametrize("eps", [0.0, -1e-3, float("inf"), float("nan")])
def test_invalid_floor_raises(eps):
    with pytest.raises(ValueError, match="eps"):
        Clamp(eps)
    with pytest.raises(ValueError, match="eps"):
        sym_clamped_log(torch.eye(3), eps)


def test_invalid_input_raises():
    with pytest.raises(ValueError, match="x: must have shape"):
        sym_log(torch.ones(3, 4))
    with pytest.raises(ValueError, match="x: must be a floating-point"):
        sym_log(torch.eye(3, dtype=torch.int64))
