"""Matrix functions of symmetric matrices with a Daleckii-Krein backward that is finite at ties.

A spectral function ``f`` acts on a symmetric matrix ``X = U diag(l) U^T`` through its eigenvalues,
``F(X) = U diag(f(l)) U^T``. Its derivative is given by the Daleckii-Krein formula

.. math:: dF = U \\left(K \\circ (U^T \\, dX \\, U)\\right) U^T, \\qquad
          K_{ij} = \\frac{f(l_i) - f(l_j)}{l_i - l_j} \\;(l_i \\neq l_j), \\quad K_{ii} = f'(l_i),

and, since ``K`` is symmetric, the gradient of a loss with respect to ``X`` is
``U (K o (U^T sym(G) U)) U^T`` for an output gradient ``G``. Plain autograd through
:func:`torch.linalg.eigh` differentiates the eigenvectors separately and divides by ``l_i - l_j``: it
returns NaN or inf as soon as two eigenvalues coincide, which is what ReEig's clamp produces. Here
the divided difference is replaced by the derivative at the midpoint, ``f'((l_i + l_j) / 2)``,
whenever ``|l_i - l_j| <= tol * max(|l_i|, |l_j|)``: that is the limit of the divided difference,
exact to second order in ``l_i - l_j`` (the divided difference equals
``f'(m) + f'''(m) (l_i - l_j)^2 / 24 + ...``), so with ``tol = eps_machine^(1/3)`` the error of
either branch is about ``eps_machine^(2/3)`` relative. The backward therefore stays finite for
repeated and clamped eigenvalues.

:func:`spectral_map` decomposes ``X`` once, outside the autograd graph, and adds the first-order
term ``U (K o (U^T (X - X0) U)) U^T`` of ``X0 = X`` detached, which is exactly zero in value and
carries exactly the Daleckii-Krein derivative. It works under :func:`torch.func.grad` and
:func:`torch.func.vmap` (per-sample gradients) as plain batched matrix products, and its derivative
is first-order only (it is not itself differentiated).

Functions (every input is a symmetric matrix of shape ``(..., n, n)``; only its symmetric part is
used; the output has the same shape):

- :func:`sym_log` -- matrix logarithm (LogEig), for SPD inputs;
- :func:`sym_clamp` -- eigenvalue floor ``max(l, eps)`` (ReEig);
- :func:`sym_clamped_log` -- ``log(max(l, eps))``, i.e. LogEig of ReEig with a single ``eigh``;
- :func:`sym_sqrt` and :func:`sym_inv_sqrt` -- square root and inverse square root, for SPD inputs.

Any other spectral function is a small class with ``value`` and ``derivative`` methods passed to
:func:`spectral_map`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "SpectralFunction",
    "Log",
    "Clamp",
    "ClampedLog",
    "Sqrt",
    "InvSqrt",
    "divided_differences",
    "spectral_map",
    "sym_log",
    "sym_clamp",
    "sym_clamped_log",
    "sym_sqrt",
    "sym_inv_sqrt",
]


class SpectralFunction(Protocol):
    """A scalar function applied elementwise to eigenvalues, with its derivative."""

    def value(self, eigvals: Tensor) -> Tensor:
        """``f(l)``, same shape as ``eigvals``."""

    def derivative(self, eigvals: Tensor) -> Tensor:
        """``f'(l)``, same shape as ``eigvals``."""


def _check_floor(eps: float) -> float:
    eps = float(eps)
    if not eps > 0.0 or eps == float("inf"):
        raise ValueError(f"eps={eps!r}: the eigenvalue floor must be a finite number > 0")
    return eps


@dataclass(frozen=True)
class Log:
    """``f(l) = log(l)``, ``f'(l) = 1 / l`` (SPD inputs)."""

    def value(self, eigvals: Tensor) -> Tensor:
        return torch.log(eigvals)

    def derivative(self, eigvals: Tensor) -> Tensor:
        return torch.reciprocal(eigvals)


@dataclass(frozen=True)
class Clamp:
    """``f(l) = max(l, eps)``; ``f'(l) = 1`` above the floor and 0 at or below it."""

    eps: float

    def __post_init__(self) -> None:
        _check_floor(self.eps)

    def value(self, eigvals: Tensor) -> Tensor:
        return torch.clamp_min(eigvals, self.eps)

    def derivative(self, eigvals: Tensor) -> Tensor:
        return (eigvals > self.eps).to(eigvals.dtype)


@dataclass(frozen=True)
class ClampedLog:
    """``f(l) = log(max(l, eps))``; ``f'(l) = 1 / l`` above the floor and 0 at or below it."""

    eps: float

    def __post_init__(self) -> None:
        _check_floor(self.eps)

    def value(self, eigvals: Tensor) -> Tensor:
        return torch.log(torch.clamp_min(eigvals, self.eps))

    def derivative(self, eigvals: Tensor) -> Tensor:
        return (eigvals > self.eps).to(eigvals.dtype) / torch.clamp_min(eigvals, self.eps)


@dataclass(frozen=True)
class Sqrt:
    """``f(l) = sqrt(l)``, ``f'(l) = 1 / (2 sqrt(l))`` (SPD inputs)."""

    def value(self, eigvals: Tensor) -> Tensor:
        return torch.sqrt(eigvals)

    def derivative(self, eigvals: Tensor) -> Tensor:
        return 0.5 * torch.rsqrt(eigvals)


@dataclass(frozen=True)
class InvSqrt:
    """``f(l) = 1 / sqrt(l)``, ``f'(l) = -1 / (2 l^{3/2})`` (SPD inputs)."""

    def value(self, eigvals: Tensor) -> Tensor:
        return torch.rsqrt(eigvals)

    def derivative(self, eigvals: Tensor) -> Tensor:
        return -0.5 * torch.rsqrt(eigvals) / eigvals


def _sym(x: Tensor) -> Tensor:
    return 0.5 * (x + x.transpose(-1, -2))


def _reconstruct(eigvecs: Tensor, values: Tensor) -> Tensor:
    """``U diag(v) U^T`` for ``U`` of shape (..., n, n) and ``v`` of shape (..., n)."""
    return (eigvecs * values.unsqueeze(-2)) @ eigvecs.transpose(-1, -2)


def divided_differences(fn: SpectralFunction, eigvals: Tensor, values: Tensor) -> Tensor:
    """The Daleckii-Krein kernel ``K`` of ``fn`` at ``eigvals``.

    Parameters
    ----------
    fn : SpectralFunction
    eigvals : Tensor, shape (..., n)
        Eigenvalues ``l``.
    values : Tensor, shape (..., n)
        ``fn.value(eigvals)`` (passed in because the forward pass has it already).

    Returns
    -------
    Tensor, shape (..., n, n)
        ``(f(l_i) - f(l_j)) / (l_i - l_j)`` where the eigenvalues are apart, and
        ``f'((l_i + l_j) / 2)`` where ``|l_i - l_j| <= tol * max(|l_i|, |l_j|)`` (including the
        diagonal), with ``tol = finfo(dtype).eps ** (1/3)``.
    """
    li, lj = eigvals.unsqueeze(-1), eigvals.unsqueeze(-2)
    gap = li - lj
    tiny = torch.finfo(eigvals.dtype).tiny
    tol = torch.finfo(eigvals.dtype).eps ** (1.0 / 3.0)
    scale = torch.maximum(li.abs(), lj.abs()).clamp_min(tiny)
    close = gap.abs() <= tol * scale
    safe_gap = torch.where(close, torch.ones_like(gap), gap)
    quotient = (values.unsqueeze(-1) - values.unsqueeze(-2)) / safe_gap
    return torch.where(close, fn.derivative(0.5 * (li + lj)), quotient)


def _first_order(x: Tensor, fn: SpectralFunction) -> Tensor:
    """``F(x)`` whose derivative is the Daleckii-Krein one, built from differentiable operations.

    With ``x = U diag(l) U^T`` decomposed once, out of the autograd graph, the output is::

        F(x0) + U (K o (U^T (x - x0) U)) U^T,      x0 = x detached,

    whose value is ``F(x0)`` exactly (``x - x0`` is exactly zero) and whose derivative with respect
    to ``x`` is ``dX -> U (K o (U^T dX U)) U^T``, the Daleckii-Krein derivative (``K`` symmetric makes
    it self-adjoint, so the backward is the same formula). Only matrix products and elementwise
    operations carry the derivative: ``torch.func.vmap`` batches them directly (per-sample
    gradients run as plain batched kernels, with no autograd ``Function`` to replay per sample), and
    the derivative is first-order (the decomposition is a constant of the graph).
    """
    x0 = x.detach()
    eigvals, eigvecs = torch.linalg.eigh(x0)
    values = fn.value(eigvals)
    out = _reconstruct(eigvecs, values)
    if not torch.is_grad_enabled():
        return out
    kernel = divided_differences(fn, eigvals, values)
    ut = eigvecs.transpose(-1, -2)
    return out + eigvecs @ (kernel * (ut @ (x - x0) @ eigvecs)) @ ut


def spectral_map(x: Tensor, fn: SpectralFunction) -> Tensor:
    """Apply the spectral function ``fn`` to the symmetric matrices ``x``.

    Parameters
    ----------
    x : Tensor, shape (..., n, n)
        Symmetric matrices (only the symmetric part ``(x + x^T) / 2`` is used).
    fn : SpectralFunction

    Returns
    -------
    Tensor, shape (..., n, n)
        ``U diag(fn.value(l)) U^T``, differentiable with the tie-safe Daleckii-Krein backward.
    """
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"x: must have shape (..., n, n) with square trailing dimensions, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x: must be a floating-point tensor, got dtype {x.dtype}")
    return _first_order(_sym(x), fn)


def sym_log(x: Tensor) -> Tensor:
    """Matrix logarithm (LogEig) of SPD matrices ``x`` of shape ``(..., n, n)``."""
    return spectral_map(x, Log())


def sym_clamp(x: Tensor, eps: float) -> Tensor:
    """ReEig: floor the eigenvalues of ``x`` (shape ``(..., n, n)``) at ``eps > 0``."""
    return spectral_map(x, Clamp(eps))


def sym_clamped_log(x: Tensor, eps: float) -> Tensor:
    """LogEig of ReEig in one ``eigh``: ``U diag(log(max(l, eps))) U^T``, shape ``(..., n, n)``."""
    return spectral_map(x, ClampedLog(eps))


def sym_sqrt(x: Tensor) -> Tensor:
    """Square root of SPD matrices ``x`` of shape ``(..., n, n)``."""
    return spectral_map(x, Sqrt())


def sym_inv_sqrt(x: Tensor) -> Tensor:
    """Inverse square root of SPD matrices ``x`` of shape ``(..., n, n)``."""
    return spectral_map(x, InvSqrt())
