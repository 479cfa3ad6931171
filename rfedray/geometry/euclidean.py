"""The flat manifold ``R^shape``: every operation is the identity or a plain sum, so Euclidean
parameter groups (e.g. a linear head) go through the same code as the curved ones."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rfedray.geometry.base import Manifold


class Euclidean(Manifold):
    """The Euclidean space ``R^shape`` itself.

    Parameters
    ----------
    *shape : int
        Shape of a point, at least one dimension, every size >= 1.
    """

    def __init__(self, *shape: int):
        if len(shape) == 0 or any(int(s) != s or s < 1 for s in shape):
            raise ValueError(f"shape={shape!r}: Euclidean needs one or more integer sizes >= 1")
        self.shape = tuple(int(s) for s in shape)
        self.dim = self.ambient_dim = math.prod(self.shape)

    def project(self, y: Tensor) -> Tensor:
        """Identity: every ambient point is on the manifold."""
        self._check_shape("y", y)
        return y

    def proj_tangent(self, x: Tensor, z: Tensor) -> Tensor:
        """Identity, broadcast to the shape of ``x`` and ``z`` together."""
        self._check_shape("z", z)
        return z.expand(torch.broadcast_shapes(x.shape, z.shape))

    def retract(self, x: Tensor, v: Tensor) -> Tensor:
        """``x + v``."""
        self._check_shape("v", v)
        return x + v

    def inv_retract(self, x: Tensor, y: Tensor) -> Tensor:
        """``y - x``."""
        self._check_shape("y", y)
        return y - x

    exp = retract
    log = inv_retract

    def random_point(
        self, *batch_shape: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """Standard normal points, shape ``(*batch_shape, *shape)``."""
        return torch.randn(*batch_shape, *self.shape, generator=generator, dtype=dtype)
