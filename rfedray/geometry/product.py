"""The product of named manifolds: a model's parameters grouped by geometry."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch
from torch import Tensor

from rfedray.geometry.base import Manifold

Point = dict[str, Tensor]


class ProductManifold:
    """``M_1 x ... x M_k`` with one named factor per parameter group, and the product metric.

    Points, tangent vectors and ambient vectors are ``dict[str, Tensor]`` with exactly the group
    names as keys; every method applies the factor's method group by group, except :meth:`norm`,
    which is joint.

    Parameters
    ----------
    groups : Mapping[str, Manifold]
        At least one group; e.g. ``{"bimap": Stiefel(22, 16), "head": Euclidean(136, 4)}``.
    """

    def __init__(self, groups: Mapping[str, Manifold]):
        if len(groups) == 0:
            raise ValueError("groups={}: a product manifold needs at least one group")
        for name, m in groups.items():
            if not isinstance(m, Manifold):
                raise ValueError(f"groups[{name!r}]={m!r}: must be an rfedray.geometry.Manifold")
        self.groups: Mapping[str, Manifold] = MappingProxyType(dict(groups))
        self.dim = sum(m.dim for m in self.groups.values())
        self.ambient_dim = sum(m.ambient_dim for m in self.groups.values())

    def check_groups(self, name: str, t: Mapping[str, Tensor]) -> None:
        """Raise ``ValueError`` naming ``name`` unless the keys of ``t`` are exactly the group names."""
        if set(t) != set(self.groups):
            missing, extra = sorted(set(self.groups) - set(t)), sorted(set(t) - set(self.groups))
            raise ValueError(
                f"{name} has groups {sorted(t)}; the product needs exactly {sorted(self.groups)}"
                + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else "")
            )

    def _apply(self, method: str, names: tuple[str, ...], *args: Mapping[str, Tensor]) -> Point:
        for name, arg in zip(names, args):
            self.check_groups(name, arg)
        return {g: getattr(m, method)(*(a[g] for a in args)) for g, m in self.groups.items()}

    def project(self, y: Mapping[str, Tensor]) -> Point:
        """Group-wise nearest-point projection ``Pi``."""
        return self._apply("project", ("y",), y)

    def proj_tangent(self, x: Mapping[str, Tensor], z: Mapping[str, Tensor]) -> Point:
        """Group-wise ``P_x z``; each ``x[g]`` broadcasts against ``z[g]`` (e.g. per-sample gradients)."""
        return self._apply("proj_tangent", ("x", "z"), x, z)

    def retract(self, x: Mapping[str, Tensor], v: Mapping[str, Tensor]) -> Point:
        """Group-wise retraction."""
        return self._apply("retract", ("x", "v"), x, v)

    def inv_retract(self, x: Mapping[str, Tensor], y: Mapping[str, Tensor]) -> Point:
        """Group-wise inverse retraction."""
        return self._apply("inv_retract", ("x", "y"), x, y)

    def exp(self, x: Mapping[str, Tensor], v: Mapping[str, Tensor]) -> Point:
        """Group-wise exponential map (the exponential of the product metric)."""
        return self._apply("exp", ("x", "v"), x, v)

    def log(self, x: Mapping[str, Tensor], y: Mapping[str, Tensor]) -> Point:
        """Group-wise logarithm."""
        return self._apply("log", ("x", "y"), x, y)

    def distance_to_manifold(self, y: Mapping[str, Tensor]) -> Point:
        """Group-wise ``||y - Pi(y)||_F``, each of shape ``(...)``."""
        return self._apply("distance_to_manifold", ("y",), y)

    def norm(self, v: Mapping[str, Tensor]) -> Tensor:
        """Joint Frobenius norm ``sqrt(sum_g ||v_g||_F^2)`` over all groups.

        Parameters
        ----------
        v : dict of Tensor
            ``v[g]`` of shape ``(..., *shape_g)`` with the same leading dimensions in every group,
            e.g. ``(B, *shape_g)`` for per-sample gradients.

        Returns
        -------
        Tensor
            Shape ``(...)``, e.g. ``(B,)``.
        """
        norms = self._apply("norm", ("v",), v)
        return torch.linalg.vector_norm(torch.stack(torch.broadcast_tensors(*norms.values())), dim=0)

    def random_point(
        self, *batch_shape: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Point:
        """A random point of every factor, ``{g: (*batch_shape, *shape_g)}``."""
        return {g: m.random_point(*batch_shape, generator=generator, dtype=dtype) for g, m in self.groups.items()}

    def __repr__(self) -> str:
        return "ProductManifold({" + ", ".join(f"{g!r}: {m!r}" for g, m in self.groups.items()) + "})"
