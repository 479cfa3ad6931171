"""The abstract embedded manifold and the small linear-algebra helpers the manifolds share.

Every manifold here is a compact (or flat) submanifold ``M`` of a Euclidean space of matrices,
with the metric induced by the Frobenius inner product of that space. A point is a tensor of shape
``(..., *shape)``; leading dimensions are batch dimensions and broadcast.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor


class NotConvergedError(RuntimeError):
    """An iterative manifold operation (e.g. a logarithm) did not reach its tolerance."""


def sym(a: Tensor) -> Tensor:
    """Symmetric part ``(A + A^T) / 2`` of ``a`` of shape ``(..., n, n)``."""
    return 0.5 * (a + a.mT)


def eye_like(a: Tensor) -> Tensor:
    """Identity of the shape, dtype and device of the square matrices ``a`` of shape ``(..., n, n)``."""
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand(a.shape)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float64: the dtype in which the projections onto a manifold are computed.

    A float32 SVD or eigendecomposition leaves its orthonormal factors about ten float32 epsilons
    off the manifold; computing them in float64 and rounding once puts the result within the
    rounding error of the float32 representation itself.
    """
    return torch.promote_types(dtype, torch.float64)


def qr_solve(a: Tensor, b: Tensor) -> Tensor:
    """Solve ``A X = B`` through a QR factorisation and one triangular solve.

    torch's CPU ``linalg.solve``, ``inv`` and ``lu_factor`` give wrong results (or raise) on
    batches of matrices of size >= 151 when running with several threads (pytorch issue 142815);
    QR and triangular solves are not affected, so this is safe at every size.

    Parameters
    ----------
    a : Tensor
        Square matrices, shape ``(..., n, n)``.
    b : Tensor
        Right-hand sides, shape ``(..., n, k)``.

    Returns
    -------
    Tensor
        ``A^{-1} B``, shape ``(..., n, k)``.
    """
    q, r = torch.linalg.qr(a)
    return torch.linalg.solve_triangular(r, q.mT @ b, upper=True)


def matrix_exp(a: Tensor) -> Tensor:
    """Matrix exponential of ``a`` of shape ``(..., n, n)`` through torch's batched code path.

    For a single matrix, torch's ``linalg.matrix_exp`` may pick a degree-8 Taylor approximation
    with a wrong coefficient (pytorch issue 196592): errors near 1e-10 in float64 and 1e-5 in
    float32 for 1-norms around 0.02-0.05 (float64) or 0.5 (float32). Batches of two or more
    matrices take another path and are accurate, so a lone matrix is evaluated next to a copy.
    """
    if a.shape[:-2].numel() > 1:
        return torch.linalg.matrix_exp(a)
    flat = a.reshape(-1, *a.shape[-2:])
    return torch.linalg.matrix_exp(torch.cat([flat, flat]))[: flat.shape[0]].reshape(a.shape)


def frobenius_norm(t: Tensor, ndim: int) -> Tensor:
    """Frobenius norm over the last ``ndim`` dimensions of ``t``: shape ``t.shape[:-ndim]``."""
    return torch.linalg.vector_norm(t.flatten(-ndim), dim=-1)


class Manifold(ABC):
    """A submanifold ``M`` of the Euclidean space ``R^shape`` with the induced (Frobenius) metric.

    Attributes
    ----------
    shape : tuple of int
        Shape of one point in the ambient space.
    dim : int
        Intrinsic dimension of ``M``.
    ambient_dim : int
        Dimension of the ambient (embedding) space.

    Notes
    -----
    The default retraction is the projection retraction ``R_x(v) = Pi(x + v)``: it is what the
    private local step ``x <- Pi(x - u)`` uses, and subclasses only override it when they offer
    another (e.g. the QR retraction of :class:`~rfedray.geometry.Stiefel`).
    """

    shape: tuple[int, ...]
    dim: int
    ambient_dim: int

    def _check_shape(self, name: str, t: Tensor) -> None:
        k = len(self.shape)
        if t.dim() < k or tuple(t.shape[-k:]) != self.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; {type(self).__name__} needs (..., "
                + ", ".join(map(str, self.shape)) + ")"
            )

    @abstractmethod
    def project(self, y: Tensor) -> Tensor:
        """Nearest-point projection ``Pi(y)``: shape ``(..., *shape)`` to ``(..., *shape)``."""

    @abstractmethod
    def proj_tangent(self, x: Tensor, z: Tensor) -> Tensor:
        """Orthogonal projection ``P_x z`` onto ``T_x M``; ``x`` broadcasts against ``z``."""

    def project_step(self, x: Tensor, v: Tensor) -> Tensor:
        """``Pi(x + v)`` for ``v`` in ``T_x M``: the local optimisers' step ``x <- Pi(x - u)``.

        The same map as the projection retraction; a manifold overrides it when knowing that ``x``
        is on ``M`` and ``v`` tangent makes ``Pi`` cheaper (:class:`~rfedray.geometry.Grassmann`).

        Parameters
        ----------
        x : Tensor
            Points of ``M``, shape ``(..., *shape)``.
        v : Tensor
            Tangent vectors at ``x``, shape ``(..., *shape)``.

        Returns
        -------
        Tensor
            Points of ``M``, the broadcast shape of ``x`` and ``v``.
        """
        self._check_shape("v", v)
        return self.project(x + v)

    def retract(self, x: Tensor, v: Tensor) -> Tensor:
        """Projection retraction ``R_x(v) = Pi(x + v)`` for ``v`` in ``T_x M``.

        Parameters
        ----------
        x : Tensor
            Points of ``M``, shape ``(..., *shape)``.
        v : Tensor
            Tangent vectors at ``x``, shape ``(..., *shape)`` (broadcasts against ``x``).

        Returns
        -------
        Tensor
            Points of ``M``, the broadcast shape of ``x`` and ``v``.
        """
        return self.project_step(x, v)

    @abstractmethod
    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """Inverse retraction: the tangent vector ``v`` at ``x`` with ``retract(x, v) = y``."""

    @abstractmethod
    def exp(self, x: Tensor, v: Tensor) -> Tensor:
        """Riemannian exponential map ``Exp_x(v)``."""

    @abstractmethod
    def log(self, x: Tensor, y: Tensor) -> Tensor:
        """Riemannian logarithm ``Log_x(y)``, the inverse of :meth:`exp` near ``x``."""

    @abstractmethod
    def random_point(
        self, *batch_shape: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """Random points of ``M``, shape ``(*batch_shape, *shape)``."""

    def distance_to_manifold(self, y: Tensor) -> Tensor:
        """Distance ``||y - Pi(y)||_F`` from ambient points to ``M``.

        Parameters
        ----------
        y : Tensor
            Ambient points, shape ``(..., *shape)``.

        Returns
        -------
        Tensor
            Shape ``(...)``.
        """
        return frobenius_norm(y - self.project(y), len(self.shape))

    def norm(self, v: Tensor) -> Tensor:
        """Frobenius norm of tangent (or ambient) vectors over the point dimensions: shape ``(...)``."""
        self._check_shape("v", v)
        return frobenius_norm(v, len(self.shape))

    def tangent_coordinates(self, x: Tensor) -> "TangentCoordinates":
        """An isometric linear chart of the tangent space at ``x`` (see :class:`TangentCoordinates`).

        The default chart is the tangent projection itself (coordinates ``P_x z``); manifolds whose
        tangent space has a smaller linear representation override it, so that per-sample
        gradients are measured and summed without being projected in full.

        Parameters
        ----------
        x : Tensor
            Points of ``M``, shape ``(..., *shape)``.
        """
        return ProjectedCoordinates(self, x)

    def tangent_norm(self, x: Tensor, z: Tensor) -> Tensor:
        """``||P_x z||_F``, measured in the manifold's tangent coordinates.

        Parameters
        ----------
        x : Tensor
            Points of ``M``, shape ``(..., *shape)``; broadcasts against ``z``.
        z : Tensor
            Ambient vectors, shape ``(..., *shape)``.

        Returns
        -------
        Tensor
            The broadcast leading shape ``(...)``.
        """
        self._check_shape("z", z)
        return frobenius_norm(self.tangent_coordinates(x).coordinates(z), len(self.shape))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(str, self.shape))})"


class TangentCoordinates(ABC):
    """An isometric linear chart ``L_x`` of the tangent space at one point ``x``.

    ``coordinates(z) = L_x P_x z`` is linear in the ambient vector ``z`` and keeps the norm,
    ``||coordinates(z)||_F = ||P_x z||_F``; ``vector`` is its inverse on the tangent space,
    ``vector(coordinates(z)) = P_x z``. Coordinates have as many trailing dimensions as a point, and
    leading dimensions broadcast like the manifold's. Because ``L_x`` is linear, a weighted sum of
    projected ambient vectors can be formed in coordinates and mapped back once:
    ``sum_l s_l P_x z_l = vector(sum_l s_l coordinates(z_l))``.
    """

    @abstractmethod
    def coordinates(self, z: Tensor) -> Tensor:
        """``L_x P_x z`` for ambient ``z`` of shape ``(..., *shape)``."""

    @abstractmethod
    def vector(self, c: Tensor) -> Tensor:
        """The tangent vector at ``x`` (shape ``(..., *shape)``) whose coordinates are ``c``."""


class ProjectedCoordinates(TangentCoordinates):
    """The default chart: the coordinates of ``z`` are ``P_x z`` itself.

    Parameters
    ----------
    manifold : Manifold
    x : Tensor
        The point, shape ``(..., *shape)``.
    """

    def __init__(self, manifold: Manifold, x: Tensor):
        self.manifold, self.x = manifold, x

    def coordinates(self, z: Tensor) -> Tensor:
        return self.manifold.proj_tangent(self.x, z)

    def vector(self, c: Tensor) -> Tensor:
        return c
