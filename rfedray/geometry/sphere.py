"""The unit sphere ``S^{n-1}`` in ``R^n``."""

from __future__ import annotations

import torch
from torch import Tensor

from rfedray.geometry.base import Manifold, working_dtype


def _inner(x: Tensor, z: Tensor) -> Tensor:
    return (x * z).sum(-1, keepdim=True)


class Sphere(Manifold):
    """The unit sphere ``S^{n-1} = {x in R^n : ||x|| = 1}``, intrinsic dimension ``n - 1``.

    Parameters
    ----------
    n : int
        Dimension of the ambient space, >= 2. Points have shape ``(..., n)``.
    """

    def __init__(self, n: int):
        if int(n) != n or n < 2:
            raise ValueError(f"n={n!r}: Sphere needs an integer ambient dimension n >= 2")
        self.shape = (int(n),)
        self.dim = int(n) - 1
        self.ambient_dim = int(n)

    def project(self, y: Tensor) -> Tensor:
        """``Pi(y) = y / ||y||`` for ``y != 0``, shape ``(..., n)``, computed in at least float64."""
        self._check_shape("y", y)
        w = y.to(working_dtype(y.dtype))
        return (w / torch.linalg.vector_norm(w, dim=-1, keepdim=True)).to(y.dtype)

    def proj_tangent(self, x: Tensor, z: Tensor) -> Tensor:
        """``P_x z = z - <x, z> x``; ``x`` broadcasts against ``z``, shape ``(..., n)``."""
        self._check_shape("z", z)
        return z - _inner(x, z) * x

    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """Inverse of ``R_x(v) = (x + v) / ||x + v||``: ``v = y / <x, y> - x``.

        Raises
        ------
        ValueError
            If ``<x, y> <= 0``: ``y`` is outside the open hemisphere around ``x``, the image of
            the projection retraction.
        """
        self._check_shape("y", y)
        c = _inner(x, y)
        if bool((c <= 0).any()):
            raise ValueError("y is outside the image of the projection retraction at x (needs <x, y> > 0)")
        return y / c - x

    def exp(self, x: Tensor, v: Tensor) -> Tensor:
        """``Exp_x(v) = cos(||v||) x + sin(||v||) v / ||v||``, renormalised against rounding drift."""
        self._check_shape("v", v)
        t = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        return self.project(torch.cos(t) * x + torch.sinc(t / torch.pi) * v)

    def log(self, x: Tensor, y: Tensor) -> Tensor:
        """``Log_x(y) = theta u / ||u||`` with ``u = P_x y`` and ``theta = atan2(||u||, <x, y>)``.

        Defined for ``y != -x``; smooth at ``y = x`` (where it is 0).
        """
        self._check_shape("y", y)
        c = _inner(x, y)
        u = y - c * x
        s = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
        tiny = torch.finfo(s.dtype).tiny
        scale = torch.where(s > 0, torch.atan2(s, c) / s.clamp_min(tiny), 1.0 / c)
        return scale * u

    def random_point(
        self, *batch_shape: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """Uniform points on the sphere, shape ``(*batch_shape, n)``."""
        return self.project(torch.randn(*batch_shape, *self.shape, generator=generator, dtype=dtype))
