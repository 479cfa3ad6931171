"""The Grassmann manifold ``Gr(d, p)`` as the rank-``p`` orthogonal projectors in ``Sym(d)``.

A subspace is stored as its projector ``X = U U^T`` (``U`` an orthonormal basis), a ``d x d``
matrix, so the ambient space is ``Sym(d)`` with the Frobenius metric (dimension ``d(d+1)/2``);
inputs in ``R^{d x d}`` are first symmetrised. This is the representation of federated PCA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rfedray.geometry.base import (
    Manifold,
    TangentCoordinates,
    eye_like,
    matrix_exp,
    qr_solve,
    sym,
    working_dtype,
)
from rfedray.geometry.stiefel import qr_factor


class _TopEigenprojector(torch.autograd.Function):
    """Projector onto the eigenspace of the ``p`` largest eigenvalues of a symmetric matrix.

    The derivative is the Daleckii-Krein formula ``dP = V (F o (V^T sym(dA) V)) V^T`` with
    ``F_ij = (f_i - f_j) / (l_i - l_j)`` for the indicator ``f`` of the top ``p`` eigenvalues and
    ``F_ij = 0`` where ``f_i = f_j``, so it stays finite at repeated eigenvalues inside each group
    (on the manifold all eigenvalues are 0 or 1, where ``eigh``'s own backward is not finite).
    The map is self-adjoint, so ``jvp`` and ``backward`` are the same formula. Computed in at
    least float64 (see :func:`~rfedray.geometry.base.working_dtype`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, p: int) -> tuple[Tensor, Tensor, Tensor]:
        evals, evecs = torch.linalg.eigh(a.to(working_dtype(a.dtype)))
        top = evecs[..., -p:]
        return (top @ top.mT).to(a.dtype), evals, evecs

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, evals, evecs = output
        ctx.p = inputs[1]
        ctx.mark_non_differentiable(evals, evecs)
        ctx.save_for_backward(evals, evecs)
        ctx.save_for_forward(evals, evecs)

    @staticmethod
    def _derivative(ctx, da: Tensor) -> Tensor:
        evals, evecs = ctx.saved_tensors
        d = evals.shape[-1]
        top = (torch.arange(d, device=evals.device) >= d - ctx.p).to(evals.dtype)
        jump = top[:, None] - top[None, :]
        gap = evals[..., :, None] - evals[..., None, :]
        f = torch.where(jump != 0, jump / torch.where(jump != 0, gap, torch.ones_like(gap)), torch.zeros_like(gap))
        return (evecs @ (f * (evecs.mT @ sym(da).to(evecs.dtype) @ evecs)) @ evecs.mT).to(da.dtype)

    @staticmethod
    def jvp(ctx, da: Tensor, dp: None) -> tuple[Tensor, None, None]:
        return _TopEigenprojector._derivative(ctx, da), None, None

    @staticmethod
    def backward(ctx, grad_p: Tensor, grad_evals: Tensor, grad_evecs: Tensor) -> tuple[Tensor, None]:
        return _TopEigenprojector._derivative(ctx, grad_p), None


_SQRT2 = 2.0 ** 0.5


class _BasisCoordinates(TangentCoordinates):
    """Tangent coordinates of ``Gr(d, p)`` at ``X`` through an orthonormal basis ``U`` (``d x q``).

    ``U`` spans the range of ``X`` or of ``I - X`` (both have the tangent projection
    ``P_X(Z) = U V^T + V U^T`` with ``V = (I - U U^T) Zs U``). Since ``U^T V = 0``,
    ``||P_X(Z)||_F^2 = 2 ||V||_F^2``, so ``c = sqrt(2) V^T`` (shape ``(..., q, d)``) is an isometric
    chart; computing it costs three ``(q x d) (d x d)`` products per ``Z`` instead of the
    ``(d x d) (d x d)`` products of the projection, and keeps ``q d`` numbers instead of ``d^2``.

    Parameters
    ----------
    u : Tensor
        Shape ``(..., d, q)``, orthonormal columns.
    """

    def __init__(self, u: Tensor):
        self.u = u
        self.scaled_ut = u.mT * (0.5 * _SQRT2)
        projector = u @ u.mT
        self.complement = eye_like(projector) - projector

    def coordinates(self, z: Tensor) -> Tensor:
        """``sqrt(2) U^T Zs (I - U U^T)`` for ``z`` of shape ``(..., d, d)``: shape ``(..., q, d)``."""
        return (self.scaled_ut @ z + self.scaled_ut @ z.mT) @ self.complement

    def vector(self, c: Tensor) -> Tensor:
        """``U V^T + V U^T`` with ``V^T = c / sqrt(2)``, symmetric to the last bit: shape ``(..., d, d)``."""
        half = (self.u @ c) * (1.0 / _SQRT2)
        return half + half.mT


class Grassmann(Manifold):
    """The Grassmann manifold ``Gr(d, p)`` of ``p``-dimensional subspaces of ``R^d``, as projectors.

    Points have shape ``(..., d, d)``; intrinsic dimension ``p(d - p)``; ambient ``Sym(d)``.
    Tangent vectors at ``X = U U^T`` are ``V = U B^T + B U^T`` with ``U^T B = 0``
    (``B = V U`` is the horizontal lift of ``V`` to the Stiefel basis ``U``).

    Parameters
    ----------
    d, p : int
        ``1 <= p < d``.
    """

    def __init__(self, d: int, p: int):
        if int(p) != p or int(d) != d or not 1 <= p < d:
            raise ValueError(f"(d, p)=({d!r}, {p!r}): Grassmann needs integers 1 <= p < d")
        self.d, self.p = int(d), int(p)
        self.shape = (self.d, self.d)
        self.dim = self.p * (self.d - self.p)
        self.ambient_dim = self.d * (self.d + 1) // 2
        self._sketches: dict[tuple, Tensor] = {}

    def project(self, y: Tensor) -> Tensor:
        """``Pi(Y) = V_p V_p^T`` for the top-``p`` eigenvectors ``V_p`` of ``sym(Y)``.

        Parameters
        ----------
        y : Tensor
            Shape ``(..., d, d)``, with a gap between the ``p``-th and ``(p+1)``-th eigenvalues of
            ``sym(y)``.

        Returns
        -------
        Tensor
            Shape ``(..., d, d)``; its backward is finite on the manifold.
        """
        self._check_shape("y", y)
        return _TopEigenprojector.apply(sym(y), self.p)[0]

    def project_step(self, x: Tensor, v: Tensor) -> Tensor:
        """``Pi(X + V)`` for tangent ``V``, by Rayleigh-Ritz on a ``2p``-dimensional subspace.

        With ``X = U U^T`` and ``V = U B^T + B U^T`` (``U^T B = 0``), ``Y = X + V`` has rank at most
        ``2p``: its range is in ``span(U, B)``, and its top-``p`` eigenspace is ``Pi(Y)``. A basis
        ``Q`` of ``Y Omega`` (``Omega`` a fixed ``d x (2p + 4)`` orthonormal sketch) contains that
        range, so the top-``p`` eigenvectors ``W`` of the small ``Q^T Y Q`` give ``Pi(Y) = (Q W)(Q W)^T``
        (the eigenvalues of ``Y`` are ``(1 + sqrt(1 + 4 s^2)) / 2 >= 1`` for the singular values
        ``s`` of ``B``, and ``<= 0`` otherwise, so the top ``p`` are separated by a gap >= 1). The
        sketch sees the top eigenspace through the ``p x (2p + 4)`` matrix ``U^T Omega``; the error
        is the rounding of ``Y`` over its smallest singular value, which is below ``e`` with
        probability of order ``e^(p + 5)`` for a subspace in general position. Cost: ``O(d^2 p)`` and an eigendecomposition
        of size ``2p + 4`` instead of ``d``; in float64, like :meth:`project`, which it matches to
        rounding (``tests/test_geometry.py``). Falls back to :meth:`project` when ``2p + 4 > d / 2``
        or when a gradient flows (``eigh``'s backward at the repeated zero Ritz values is not finite).

        Parameters
        ----------
        x : Tensor
            Points of Gr, shape ``(..., d, d)``.
        v : Tensor
            Tangent vectors at ``x``, shape ``(..., d, d)``.
        """
        self._check_shape("v", v)
        width = 2 * self.p + 4
        if 2 * width > self.d or (torch.is_grad_enabled() and (x.requires_grad or v.requires_grad)):
            return self.project(x + v)
        y = sym(x + v).to(working_dtype(x.dtype))
        q = torch.linalg.qr(y @ self._sketch(width, y)).Q
        w = torch.linalg.eigh(q.mT @ y @ q)[1][..., -self.p:]
        u = q @ w
        return (u @ u.mT).to(x.dtype)

    def _sketch(self, width: int, like: Tensor) -> Tensor:
        """The fixed ``d x width`` orthonormal test matrix of :meth:`project_step` (seed 0), on the
        device and in the dtype of ``like``."""
        key = (width, like.device, like.dtype)
        if key not in self._sketches:
            g = torch.Generator().manual_seed(0)
            omega = torch.linalg.qr(torch.randn(self.d, width, generator=g, dtype=torch.float64)).Q
            self._sketches[key] = omega.to(device=like.device, dtype=like.dtype)
        return self._sketches[key]

    def proj_tangent(self, x: Tensor, z: Tensor) -> Tensor:
        """``P_X(Z) = X Zs + Zs X - 2 X Zs X`` with ``Zs = sym(Z)``; ``x`` broadcasts against ``z``.

        When one point ``x`` of shape ``(d, d)`` meets a batch ``z`` of shape ``(B, d, d)`` (the
        per-sample gradients of the private step) and no gradient flows to ``x``, the projection
        goes through a basis ``U`` of ``x`` (one ``eigh``): with ``W = Zs U`` and
        ``V = W - U (U^T W)``, ``P_X(Z) = U V^T + V U^T``, which costs ``O(B d^2 p)`` instead of
        ``O(B d^3)``. Both forms agree on the manifold.
        """
        self._check_shape("z", z)
        zs = sym(z)
        if x.dim() == 2 and z.dim() > 2 and 4 * self.p <= self.d and not (torch.is_grad_enabled() and x.requires_grad):
            u = torch.linalg.eigh(sym(x).to(working_dtype(x.dtype)))[1][:, -self.p:].to(x.dtype)
            w = zs @ u
            v = w - u @ (u.mT @ w)
            return u @ v.mT + v @ u.mT
        xz = x @ zs
        return xz + xz.mT - 2.0 * xz @ x

    def tangent_coordinates(self, x: Tensor) -> TangentCoordinates:
        """Coordinates through an orthonormal basis of the range of ``x`` or of its complement.

        The basis has ``q = min(p, d - p)`` columns (one ``eigh`` of ``x``), so the coordinates of a
        batch of ambient ``z`` cost ``O(d^2 q)`` each and take ``q d`` numbers instead of ``d^2``
        (see :class:`_BasisCoordinates`). When a gradient flows to ``x``, the default chart
        (the projection itself) is used, which differentiates through ``x``.

        Parameters
        ----------
        x : Tensor
            Points of Gr, shape ``(..., d, d)``.
        """
        if torch.is_grad_enabled() and x.requires_grad:
            return super().tangent_coordinates(x)
        evecs = torch.linalg.eigh(x.to(working_dtype(x.dtype)))[1]  # eigh reads one triangle of x
        basis = evecs[..., -self.p:] if self.p <= self.d - self.p else evecs[..., : self.d - self.p]
        return _BasisCoordinates(basis.to(x.dtype))

    def _basis(self, x: Tensor) -> Tensor:
        """An orthonormal basis ``U`` (shape ``(..., d, p)``) of the range of the projector ``x``.

        It is ``X U0`` with ``U0`` the (detached) top eigenvectors: equal to ``U0`` in value, and
        its derivative along a tangent ``dX`` is ``dX U0``, the first-order motion of a basis of
        the subspace; so the maps built on it differentiate correctly, which ``eigh``'s backward
        at the repeated eigenvalues 0 and 1 would not.
        """
        u0 = torch.linalg.eigh(sym(x).detach())[1][..., -self.p:]
        return x @ u0

    def _lift(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Basis ``U`` of ``x`` and ``Bt = (I - U U^T) W (U^T W)^{-1}`` for a basis ``W`` of ``y``.

        ``span(U + Bt) = span(W)``; the singular values of ``Bt`` are the tangents of the
        principal angles between the two subspaces.
        """
        u, w = self._basis(x), self._basis(y)
        m = u.mT @ w
        return u, qr_solve(m.mT, (w - u @ m).mT).mT

    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """Inverse of the projection retraction ``R_X(V) = Pi(X + V)``, in closed form.

        With ``V = U B^T + B U^T``, ``R_X(V) = span(U + B g(B^T B))`` for
        ``g(t) = 2 / (1 + sqrt(1 + 4t))``, so ``Bt = B g(B^T B)`` and ``B = Bt (I - Bt^T Bt)^{-1}``.

        Raises
        ------
        ValueError
            If a principal angle between ``x`` and ``y`` is 45 degrees or more: the image of the
            projection retraction at ``x``.
        """
        self._check_shape("y", y)
        u, bt = self._lift(x, y)
        gram = eye_like(bt.mT @ bt) - bt.mT @ bt
        chol, info = torch.linalg.cholesky_ex(gram)
        if bool((info != 0).any()):
            raise ValueError(
                "y is outside the image of the projection retraction at x (principal angles >= 45 degrees)"
            )
        b = torch.cholesky_solve(bt.mT, chol).mT
        return u @ b.mT + b @ u.mT

    def exp(self, x: Tensor, v: Tensor) -> Tensor:
        """``Exp_X(V) = e^O X e^{-O}`` with the skew ``O = [V, X] = V X - X V``.

        Re-projected onto Gr (a no-op in exact arithmetic) so that rounding errors do not
        accumulate over repeated use. Shapes ``(..., d, d)``; ``x`` broadcasts against ``v``.
        """
        self._check_shape("v", v)
        omega = v @ x - x @ v
        rot = matrix_exp(omega)
        return self.project(rot @ x @ rot.mT)

    def log(self, x: Tensor, y: Tensor) -> Tensor:
        """``Log_X(Y) = U B^T + B U^T`` with ``B = Q atan(S) R^T`` for the thin SVD ``Q S R^T`` of ``Bt``.

        Closed form (Absil, Mahony and Sepulchre 2004), defined when no principal angle between
        ``x`` and ``y`` is 90 degrees; differentiable where the principal angles are distinct.
        """
        self._check_shape("y", y)
        u, bt = self._lift(x, y)
        q, s, rh = torch.linalg.svd(bt, full_matrices=False)
        b = (q * torch.atan(s)[..., None, :]) @ rh
        return u @ b.mT + b @ u.mT

    def random_point(
        self, *batch_shape: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """Uniformly distributed subspaces, shape ``(*batch_shape, d, d)``."""
        u = qr_factor(torch.randn(*batch_shape, self.d, self.p, generator=generator, dtype=dtype))
        return u @ u.mT

    def __repr__(self) -> str:
        return f"Grassmann({self.d}, {self.p})"
