"""Server-side aggregation on a product manifold: a scheme is a (client submission, server combine)
pair, applied group by group.

Round ``t``: each client of the cohort sends ``Sub(theta_t, theta_local)``; the server takes the
(weighted) mean of the submissions and sets ``theta_{t+1} = Out(theta_t, mean)``.

==========  ===============================================  ============================
scheme      submission ``Sub(theta_t, theta_local)``         combine ``Out(theta_t, m)``
==========  ===============================================  ============================
ProjAvg     ``theta_local``                                  ``Pi(m)``
RLAvg       ``P_{theta_t}(theta_local - theta_t)``           ``Pi(theta_t + m)``
RetAvg      ``R^{-1}_{theta_t}(theta_local)``                ``R_{theta_t}(m)``
KFAvg       ``Log_{theta_t}(theta_local)``                   ``Exp_{theta_t}(m)``
==========  ===============================================  ============================

On a Euclidean group every scheme is the plain (weighted) average of the local iterates. The
schemes only post-process privatised iterates, so none of them changes the privacy guarantee.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Mapping, Sequence

import torch
from torch import Tensor

from rfedray.geometry import Manifold, ProductManifold


class AggregationScheme(ABC):
    """A client submission map and a server combine map, for one manifold factor.

    Both are static: a scheme has no state, so ``ProjAvg`` and ``ProjAvg()`` can be passed alike.
    """

    name: str

    @staticmethod
    @abstractmethod
    def submission(manifold: Manifold, theta_t: Tensor, theta_local: Tensor) -> Tensor:
        """What a client sends, from the round's start point ``theta_t`` and its local iterate.

        Parameters
        ----------
        manifold : Manifold
        theta_t : Tensor
            Shape ``(*shape)``; broadcasts against ``theta_local``.
        theta_local : Tensor
            Shape ``(..., *shape)`` (several clients may be stacked in front).

        Returns
        -------
        Tensor
            Shape ``(..., *shape)``.
        """

    @staticmethod
    @abstractmethod
    def combine(manifold: Manifold, theta_t: Tensor, mean: Tensor) -> Tensor:
        """The next global point from ``theta_t`` and the mean of the submissions, shape ``(*shape)``."""

    @staticmethod
    def displacement(manifold: Manifold, theta_t: Tensor, submission: Tensor) -> Tensor:
        """The tangent vector at ``theta_t`` a submission stands for, to first order in the local step
        (``theta_local - theta_t`` projected): the submission itself where it is a tangent vector."""
        return submission


class ProjAvg(AggregationScheme):
    """Average the local iterates in the ambient space and project: ``Pi(mean theta_local)``."""

    name = "projavg"

    @staticmethod
    def submission(manifold: Manifold, theta_t: Tensor, theta_local: Tensor) -> Tensor:
        return theta_local

    @staticmethod
    def combine(manifold: Manifold, theta_t: Tensor, mean: Tensor) -> Tensor:
        return manifold.project(mean)

    @staticmethod
    def displacement(manifold: Manifold, theta_t: Tensor, submission: Tensor) -> Tensor:
        return manifold.proj_tangent(theta_t, submission - theta_t)


class RLAvg(AggregationScheme):
    """Retraction-and-lifting average: lift ``P_{theta_t}(theta_local - theta_t)``, retract by ``Pi``.

    The lifting is the tangent projection, not the inverse of the projection retraction, so when
    every client sends the same ``y`` the result is ``y`` only up to ``O(|y - theta_t|^3)``.
    """

    name = "rlavg"

    @staticmethod
    def submission(manifold: Manifold, theta_t: Tensor, theta_local: Tensor) -> Tensor:
        return manifold.proj_tangent(theta_t, theta_local - theta_t)

    @staticmethod
    def combine(manifold: Manifold, theta_t: Tensor, mean: Tensor) -> Tensor:
        return manifold.project(theta_t + mean)


class RetAvg(AggregationScheme):
    """Average in ``T_{theta_t}`` through the manifold's retraction and its exact inverse."""

    name = "retavg"

    @staticmethod
    def submission(manifold: Manifold, theta_t: Tensor, theta_local: Tensor) -> Tensor:
        return manifold.inv_retract(theta_t, theta_local)

    @staticmethod
    def combine(manifold: Manifold, theta_t: Tensor, mean: Tensor) -> Tensor:
        return manifold.retract(theta_t, mean)


class KFAvg(AggregationScheme):
    """Average in ``T_{theta_t}`` through the Riemannian logarithm and exponential (Karcher-Frechet step)."""

    name = "kfavg"

    @staticmethod
    def submission(manifold: Manifold, theta_t: Tensor, theta_local: Tensor) -> Tensor:
        return manifold.log(theta_t, theta_local)

    @staticmethod
    def combine(manifold: Manifold, theta_t: Tensor, mean: Tensor) -> Tensor:
        return manifold.exp(theta_t, mean)


SCHEMES: dict[str, type[AggregationScheme]] = {"projavg": ProjAvg, "rlavg": RLAvg, "retavg": RetAvg, "kfavg": KFAvg}


def _check_scheme(scheme: AggregationScheme | type[AggregationScheme]) -> None:
    kind = scheme if isinstance(scheme, type) else type(scheme)
    if not (issubclass(kind, AggregationScheme) and kind is not AggregationScheme):
        raise ValueError(f"scheme={scheme!r}: must be one of {', '.join(c.__name__ for c in SCHEMES.values())}")


def submit(
    scheme: AggregationScheme | type[AggregationScheme],
    product: ProductManifold,
    theta_t: Mapping[str, Tensor],
    theta_local: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """A client's submission, group by group.

    Parameters
    ----------
    scheme : AggregationScheme or its class
    product : ProductManifold
    theta_t : dict of Tensor
        The round's start point, ``{group: (*shape_g)}``.
    theta_local : dict of Tensor
        The client's local iterate, ``{group: (..., *shape_g)}``; iterates of several clients may
        be stacked in front.

    Returns
    -------
    dict of Tensor
        ``{group: (..., *shape_g)}``.
    """
    _check_scheme(scheme)
    product.check_groups("theta_t", theta_t)
    product.check_groups("theta_local", theta_local)
    return {g: scheme.submission(m, theta_t[g], theta_local[g]) for g, m in product.groups.items()}


def displacement(
    scheme: AggregationScheme | type[AggregationScheme],
    product: ProductManifold,
    theta_t: Mapping[str, Tensor],
    submission: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """The tangent displacement at ``theta_t`` a client's submission stands for, group by group
    (:meth:`AggregationScheme.displacement`): what an observer of the submission learns of the
    client's local steps, ``-eta sum_j g_j`` to first order.

    Returns
    -------
    dict of Tensor
        ``{group: (*shape_g)}``, tangent at ``theta_t``.
    """
    _check_scheme(scheme)
    return {g: scheme.displacement(m, theta_t[g], submission[g]) for g, m in product.groups.items()}


def _normalised_weights(weights: Sequence[float] | None, k: int, like: Tensor) -> Tensor:
    if weights is None:
        return torch.full((k,), 1.0 / k, dtype=like.dtype, device=like.device)
    w = [float(x) for x in weights]
    if len(w) != k:
        raise ValueError(f"weights has {len(w)} entries for {k} submissions: give one weight per submission")
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights={w!r}: must be finite, >= 0 and not all 0")
    t = torch.tensor(w, dtype=like.dtype, device=like.device)
    return t / t.sum()


def combine(
    scheme: AggregationScheme | type[AggregationScheme],
    product: ProductManifold,
    theta_t: Mapping[str, Tensor],
    submissions: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float] | None = None,
) -> dict[str, Tensor]:
    """The next global point: weighted mean of the submissions, then the scheme's combine, per group.

    Parameters
    ----------
    scheme : AggregationScheme or its class
    product : ProductManifold
    theta_t : dict of Tensor
        The round's start point, ``{group: (*shape_g)}``.
    submissions : sequence of dict of Tensor
        One :func:`submit` result per client of the cohort, at least one.
    weights : sequence of float, optional
        One non-negative weight per submission (e.g. the clients' numbers of records), normalised
        to sum to 1; uniform by default.

    Returns
    -------
    dict of Tensor
        ``theta_{t+1}``, ``{group: (*shape_g)}``.
    """
    _check_scheme(scheme)
    product.check_groups("theta_t", theta_t)
    if len(submissions) == 0:
        raise ValueError("submissions is empty: combine needs at least one client's submission")
    for i, sub in enumerate(submissions):
        product.check_groups(f"submissions[{i}]", sub)
    first = next(iter(theta_t.values()))
    w = _normalised_weights(weights, len(submissions), first)
    out = {}
    for g, m in product.groups.items():
        stacked = torch.stack([sub[g] for sub in submissions])
        mean = torch.tensordot(w.to(stacked.dtype), stacked, dims=1)
        out[g] = scheme.combine(m, theta_t[g], mean)
    return out
