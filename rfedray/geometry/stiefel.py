"""The Stiefel manifold ``St(d, p) = {X in R^{d x p} : X^T X = I_p}`` with the Euclidean metric.

The metric is the one induced by the Frobenius inner product of ``R^{d x p}`` (Edelman, Arias and
Smith's "Euclidean" metric), so ``P_X`` is the orthogonal projection that clipping and noise need.
geoopt's default ``Stiefel`` (``CanonicalStiefel``) uses the canonical metric instead; its
``proju`` is not an orthogonal projection of ``R^{d x p}`` and is not used here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from rfedray.geometry.base import (
    Manifold,
    NotConvergedError,
    eye_like,
    frobenius_norm,
    matrix_exp,
    qr_solve,
    sym,
    working_dtype,
)


class _PolarFactor(torch.autograd.Function):
    """Orthogonal polar factor ``Q = U V^T`` of ``Y = U S V^T``, with derivatives that stay finite
    at repeated singular values (on the manifold all of them are 1, where the SVD's own backward
    divides by zero).

    With ``Y = Q H`` (``H = V S V^T``), ``dQ = Q Omega + (I - Q Q^T) dY H^{-1}`` where the skew
    ``Omega`` solves ``Omega H + H Omega = Q^T dY - dY^T Q``; in the eigenbasis of ``H`` this is
    an elementwise division by ``s_i + s_j > 0``. ``jvp`` is that map and ``backward`` its adjoint.
    Computed in at least float64 (see :func:`~rfedray.geometry.base.working_dtype`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        u, s, vh = torch.linalg.svd(y.to(working_dtype(y.dtype)), full_matrices=False)
        return (u @ vh).to(y.dtype), s, vh

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, s, vh = output
        ctx.mark_non_differentiable(s, vh)
        ctx.save_for_backward(q, s, vh)
        ctx.save_for_forward(q, s, vh)

    @staticmethod
    def _derivative(ctx, g: Tensor) -> Tensor:
        """``Q V [(V^T (A - A^T) V) / (s_i + s_j)] V^T + (G - Q A) V S^{-1} V^T`` with ``A = Q^T G``."""
        q, s, vh = ctx.saved_tensors
        q, w = q.to(s.dtype), g.to(s.dtype)
        a = q.mT @ w
        v = vh.mT
        rotation = (vh @ (a - a.mT) @ v) / (s[..., :, None] + s[..., None, :])
        return ((q @ (v @ rotation) + (w - q @ a) @ (v / s[..., None, :])) @ vh).to(g.dtype)

    @staticmethod
    def jvp(ctx, dy: Tensor) -> tuple[Tensor, None, None]:
        return _PolarFactor._derivative(ctx, dy), None, None

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_s: Tensor, grad_vh: Tensor) -> Tensor:
        return _PolarFactor._derivative(ctx, grad_q)


def polar_factor(y: Tensor) -> Tensor:
    """Orthogonal polar factor of full-rank ``y`` of shape ``(..., d, p)``: the nearest point of St(d, p)."""
    return _PolarFactor.apply(y)[0]


def qr_factor(y: Tensor) -> Tensor:
    """Q factor of the thin QR decomposition ``y = Q R`` with ``diag(R) > 0``, shape ``(..., d, p)``.

    Computed in at least float64 (see :func:`~rfedray.geometry.base.working_dtype`).
    """
    q, r = torch.linalg.qr(y.to(working_dtype(y.dtype)))
    sign = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    return (q * sign[..., None, :]).to(y.dtype)


class StiefelRetraction(ABC):
    """A retraction of St(d, p) together with its inverse."""

    @abstractmethod
    def retract(self, x: Tensor, v: Tensor) -> Tensor:
        """``R_x(v)`` for ``x`` of shape ``(..., d, p)`` and ``v`` in ``T_x St``."""

    @abstractmethod
    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """The tangent ``v`` at ``x`` with ``R_x(v) = y``."""

    def __repr__(self) -> str:
        return type(self).__name__


class PolarRetraction(StiefelRetraction):
    """``R_X(V) = Pi(X + V) = (X + V)(I + V^T V)^{-1/2}``, the projection retraction.

    Its inverse: ``X + V = Y S`` with ``S`` symmetric positive definite, and tangency of ``V``
    gives the ``p x p`` Lyapunov equation ``A S + S A^T = 2 I`` with ``A = X^T Y``. It has an SPD
    solution exactly when every eigenvalue of ``A`` has a positive real part, which is also when
    ``Y`` lies in the image of ``R_X``. It is solved with Roberts' matrix-sign-function Newton
    iteration (``A <- (A + A^{-1}) / 2``, ``C <- (C + A^{-1} C A^{-T}) / 2`` from ``C = 2 I``,
    giving ``A -> I`` and ``C -> 2 S``), which converges quadratically and costs ``O(p^3)`` per step
    with no eigen- or LU decomposition.

    Parameters
    ----------
    max_iter : int
        Most Newton steps before giving up, >= 1.
    """

    def __init__(self, max_iter: int = 100):
        if int(max_iter) != max_iter or max_iter < 1:
            raise ValueError(f"max_iter={max_iter!r}: must be an integer >= 1")
        self.max_iter = int(max_iter)

    def retract(self, x: Tensor, v: Tensor) -> Tensor:
        return polar_factor(x + v)

    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """Solve ``A S + S A^T = 2 I`` for ``A = X^T Y`` and return ``V = Y S - X``.

        Raises
        ------
        ValueError
            If ``y`` is not in the image of the polar retraction at ``x``.
        """
        a = x.mT @ y
        eye = eye_like(a)
        c = 2.0 * eye
        stop = torch.finfo(a.dtype).eps ** 0.5
        for _ in range(self.max_iter):
            err = frobenius_norm(a - eye, 2)
            a_inv = qr_solve(a, eye)
            c = 0.5 * (c + a_inv @ c @ a_inv.mT)
            a = 0.5 * (a + a_inv)
            if not bool(torch.isfinite(err).all()):
                break
            if float(err.max()) <= stop:
                return y @ (0.5 * c) - x
        raise ValueError(
            "y is outside the image of the polar retraction at x: X^T Y must have eigenvalues "
            "with positive real part"
        )


class QRRetraction(StiefelRetraction):
    """``R_X(V) = qf(X + V)``, the Q factor of the thin QR decomposition with positive ``diag(R)``.

    Its inverse: ``X + V = Y R`` with ``R`` upper triangular, and tangency of ``V`` gives
    ``M R + R^T M^T = 2 I`` with ``M = X^T Y``. Column ``k`` of ``R`` solves a system with the
    leading ``(k+1) x (k+1)`` block of ``M``, whose right-hand side depends on the earlier columns.
    The leading blocks are factored once by growing an LU factorisation ``M = L U`` without
    pivoting (each new row of ``L`` and column of ``U`` is a triangular solve), so every column
    costs two triangular solves: ``O(p^3)`` in all, with no LU routine from torch.
    """

    def retract(self, x: Tensor, v: Tensor) -> Tensor:
        return qr_factor(x + v)

    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """Solve ``M R + R^T M^T = 2 I`` column by column and return ``V = Y R - X``.

        Raises
        ------
        ValueError
            If ``y`` is not in the image of the QR retraction at ``x`` (a leading block of
            ``X^T Y`` is singular or ``diag(R)`` is not positive).
        """
        m = x.mT @ y
        p = m.shape[-1]
        batch = m.shape[:-2]
        one = torch.ones(*batch, 1, 1, dtype=m.dtype, device=m.device)
        lower, upper = one, m[..., :1, :1]
        r = m.new_zeros(*batch, p, 0)
        for k in range(p):
            if k > 0:
                u_col = torch.linalg.solve_triangular(lower, m[..., :k, k:k + 1], upper=False, unitriangular=True)
                l_row = torch.linalg.solve_triangular(upper, m[..., k:k + 1, :k], upper=True, left=False)
                u_kk = m[..., k:k + 1, k:k + 1] - l_row @ u_col
                lower = torch.cat([torch.cat([lower, torch.zeros_like(u_col)], -1), torch.cat([l_row, one], -1)], -2)
                upper = torch.cat([torch.cat([upper, u_col], -1), torch.cat([torch.zeros_like(l_row), u_kk], -1)], -2)
            rhs = torch.cat([-(m[..., k:k + 1, :] @ r).mT, one], -2)
            col = torch.linalg.solve_triangular(
                upper, torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True), upper=True
            )
            r = torch.cat([r, torch.cat([col, m.new_zeros(*batch, p - k - 1, 1)], -2)], -1)
        diag = torch.diagonal(r, dim1=-2, dim2=-1)
        if not bool(torch.isfinite(r).all() and (diag > 0).all()):
            raise ValueError("y is outside the image of the QR retraction at x")
        return y @ r - x


STIEFEL_RETRACTIONS = {"polar": PolarRetraction, "qr": QRRetraction}


class Stiefel(Manifold):
    """The Stiefel manifold ``St(d, p)`` of ``d x p`` matrices with orthonormal columns.

    Intrinsic dimension ``dp - p(p+1)/2``, ambient space ``R^{d x p}`` with the Frobenius metric.

    Parameters
    ----------
    d, p : int
        ``1 <= p <= d``.
    retraction : StiefelRetraction or its class
        :class:`PolarRetraction` (default, the projection retraction) or :class:`QRRetraction`;
        ``STIEFEL_RETRACTIONS`` maps the configuration names to these classes.
    log_tol : float, optional
        Tolerance of :meth:`log` on ``||Exp_x(v) - y||_F``; by default ``32 eps sqrt(dp)`` for the
        machine epsilon ``eps`` of the dtype (rounding puts a floor of about ``eps sqrt(dp)`` on
        that residual).
    log_max_iter : int
        Most iterations of :meth:`log` before it raises :class:`NotConvergedError`.
    """

    def __init__(
        self,
        d: int,
        p: int,
        retraction: StiefelRetraction | type[StiefelRetraction] = PolarRetraction,
        log_tol: float | None = None,
        log_max_iter: int = 200,
    ):
        if int(p) != p or int(d) != d or not 1 <= p <= d:
            raise ValueError(f"(d, p)=({d!r}, {p!r}): Stiefel needs integers 1 <= p <= d")
        if isinstance(retraction, type):
            retraction = retraction()
        if not isinstance(retraction, StiefelRetraction):
            allowed = ", ".join(c.__name__ for c in STIEFEL_RETRACTIONS.values())
            raise ValueError(f"retraction={retraction!r}: must be one of {allowed} (class or instance)")
        if log_tol is not None and not log_tol > 0:
            raise ValueError(f"log_tol={log_tol!r}: must be None or a number > 0")
        if int(log_max_iter) != log_max_iter or log_max_iter < 1:
            raise ValueError(f"log_max_iter={log_max_iter!r}: must be an integer >= 1")
        self.d, self.p = int(d), int(p)
        self.shape = (self.d, self.p)
        self.dim = self.d * self.p - self.p * (self.p + 1) // 2
        self.ambient_dim = self.d * self.p
        self.retraction = retraction
        self.log_tol = log_tol
        self.log_max_iter = int(log_max_iter)

    def project(self, y: Tensor) -> Tensor:
        """``Pi(Y) = U V^T`` for the thin SVD ``Y = U S V^T`` (the polar factor), ``Y`` of full rank.

        Parameters
        ----------
        y : Tensor
            Shape ``(..., d, p)``.

        Returns
        -------
        Tensor
            Shape ``(..., d, p)``; its backward is finite at repeated singular values.
        """
        self._check_shape("y", y)
        return polar_factor(y)

    def proj_tangent(self, x: Tensor, z: Tensor) -> Tensor:
        """``P_X(Z) = Z - X sym(X^T Z)``; ``x`` of shape ``(..., d, p)`` broadcasts against ``z``."""
        self._check_shape("z", z)
        return z - x @ sym(x.mT @ z)

    def retract(self, x: Tensor, v: Tensor) -> Tensor:
        """The chosen retraction ``R_x(v)``, shape ``(..., d, p)``."""
        self._check_shape("v", v)
        return self.retraction.retract(x, v)

    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """The inverse of the chosen retraction, shape ``(..., d, p)``."""
        self._check_shape("y", y)
        return self.retraction.inv_retract(x, y)

    def _geodesic(self, x: Tensor, v: Tensor) -> Tensor:
        a = x.mT @ v
        eye = eye_like(a)
        block = torch.cat([torch.cat([a, -(v.mT @ v)], -1), torch.cat([eye, a], -1)], -2)
        head = matrix_exp(block)[..., : self.p]
        return torch.cat(torch.broadcast_tensors(x, v), -1) @ head @ matrix_exp(-a)

    def exp(self, x: Tensor, v: Tensor) -> Tensor:
        """Exponential map of the Euclidean metric (Edelman, Arias and Smith 1998, eq. 2.14).

        ``Exp_X(V) = [X, V] expm([[A, -S], [I, A]]) [I; 0] expm(-A)`` with ``A = X^T V`` and
        ``S = V^T V``; the result is re-projected onto St (a no-op in exact arithmetic) so that
        rounding errors do not accumulate when it is applied over and over.

        Parameters
        ----------
        x : Tensor
            Shape ``(..., d, p)``, broadcasts against ``v``.
        v : Tensor
            Tangent vectors at ``x``, shape ``(..., d, p)``.
        """
        self._check_shape("v", v)
        return polar_factor(self._geodesic(x, v))

    def log(self, x: Tensor, y: Tensor) -> Tensor:
        """Logarithm of the Euclidean metric by the shooting method of Zimmermann and Hueper (2022).

        ``Log_X(Y)`` has no closed form, and Zimmermann's algebraic algorithm (2017) is for the
        canonical metric only. Following "Computing the Riemannian logarithm on the Stiefel
        manifold: metrics, methods and performance" (Zimmermann and Hueper, SIAM J. Matrix Anal.
        Appl. 2022), the shooting method starts from ``V = P_X(Y - X)`` rescaled to
        ``||Y - X||``, and repeats: ``W = Exp_X(V) - Y``; carry ``W`` back to ``T_X`` by projecting
        it onto ``T_{Exp_X(V)}`` then onto ``T_X`` and rescaling it to ``||W||`` (an approximate
        parallel transport); ``V <- V - W``; until ``||W||_F <= tol``.

        Parameters
        ----------
        x, y : Tensor
            Points of St, shape ``(..., d, p)``; ``x`` broadcasts against ``y``.

        Returns
        -------
        Tensor
            ``V`` in ``T_x St`` with ``Exp_x(V) = y``, shape ``(..., d, p)``.

        Raises
        ------
        NotConvergedError
            If some ``||Exp_x(V) - y||_F`` is still above the tolerance after ``log_max_iter``
            iterations (e.g. ``y`` too far from ``x``).
        """
        self._check_shape("y", y)
        x, y = torch.broadcast_tensors(x, y)
        tol = self.log_tol if self.log_tol is not None else 32 * torch.finfo(y.dtype).eps * self.ambient_dim**0.5
        gap = y - x
        v = _rescale(self.proj_tangent(x, gap), frobenius_norm(gap, 2))
        for _ in range(self.log_max_iter):
            z = self._geodesic(x, v)
            gap = z - y
            err = frobenius_norm(gap, 2)
            if float(err.max()) <= tol:
                return v
            v = v - _rescale(self.proj_tangent(x, self.proj_tangent(z, gap)), err)
        raise NotConvergedError(
            f"Stiefel log did not converge in {self.log_max_iter} iterations: "
            f"||Exp_x(v) - y|| = {float(err.max()):.3g} > tol = {tol:.3g}"
        )

    def random_point(
        self, *batch_shape: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """Haar-distributed points (Q factor of a Gaussian matrix), shape ``(*batch_shape, d, p)``."""
        return qr_factor(torch.randn(*batch_shape, self.d, self.p, generator=generator, dtype=dtype))

    def __repr__(self) -> str:
        return f"Stiefel({self.d}, {self.p}, retraction={self.retraction!r})"


def _rescale(w: Tensor, target: Tensor) -> Tensor:
    """``w`` rescaled to Frobenius norm ``target`` (shape ``(...)``); zero stays zero."""
    n = frobenius_norm(w, 2)
    scale = torch.where(n > 0, target / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n))
    return w * scale[..., None, None]
