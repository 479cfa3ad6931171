"""Federated PCA: find the top-p subspace of the pooled covariance, privately.

The parameter is a rank-p projector ``P`` on the Grassmann manifold Gr(d, p) (the paper's
setting), or an orthonormal basis ``U`` on St(d, p) (projector ``U U^T``), or a unit vector on the
sphere (p = 1). The loss of a record ``z`` is ``f(P; z) = -z^T P z``; its population version
``F(P) = -tr(P Sigma)`` is minimised by the top-p eigenspace ``P*`` of ``Sigma``.

Metrics: the optimality gap ``F(P) - F(P*)`` and the chordal distance ``||P - P*||_F / sqrt(2)``
(the sine-theta distance between the subspaces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from rfedray.options import DTYPES, Checked, OptionsError, Rule, one_of, ranged
from rfedray.geometry import Grassmann, Manifold, PolarRetraction, Sphere, Stiefel
from rfedray.task import EvalData, Params

GROUP = "subspace"


class ProjectorGradients:
    """Closed-form per-record gradients of ``f(P; z) = -z^T P z`` on Gr(d, p)
    (a :class:`~rfedray.privacy.mechanism.PerSampleRule`).

    A record's ambient gradient is ``-z z^T``. With ``a = P z`` and ``b = z - a`` (orthogonal, as
    ``P`` is a projector), its tangent projection ``P_P(z z^T) = a b^T + b a^T`` has norm
    ``sqrt(2) ||a|| ||b||``; a weighted sum of the gradients is ``-Z^T diag(w) Z``. Both cost
    ``O(B d^2)`` with no ``(B, d, d)`` tensor.
    """

    @staticmethod
    def tangent_norms(params: Params, records: tuple[Tensor, ...]) -> Tensor:
        """Shape ``(..., B)`` for records ``z`` of shape ``(..., B, d)`` and ``P`` of shape ``(..., d, d)``."""
        (z,) = records
        a = z @ params[GROUP]
        return (2.0 ** 0.5) * torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(z - a, dim=-1)

    @classmethod
    def group_tangent_norms(cls, params: Params, records: tuple[Tensor, ...]) -> Params:
        """The one group's norms, ``{GROUP: (..., B)}``."""
        return {GROUP: cls.tangent_norms(params, records)}

    @staticmethod
    def weighted_gradient(params: Params, records: tuple[Tensor, ...], weights: Tensor) -> Params:
        """``-sum_l w_l z_l z_l^T``, shape ``(..., d, d)``; records of weight 0 are left out exactly."""
        (z,) = records
        kept = torch.where((weights != 0)[..., None], z, 0.0)
        return {GROUP: -(kept.mT * weights[..., None, :]) @ kept}


class GrassmannPCA:
    """Projector parametrisation: the point is ``P`` itself, shape (d, d)."""

    gradient_rule = ProjectorGradients()

    def __init__(self, d: int, p: int, retraction=None):
        self.manifold: Manifold = Grassmann(d, p)

    @staticmethod
    def projector(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def point(basis: Tensor) -> Tensor:
        """The point spanned by the orthonormal ``basis`` (d, p)."""
        return basis @ basis.T


class StiefelPCA:
    """Basis parametrisation: the point is ``U``, shape (d, p), projector ``U U^T``."""

    gradient_rule = None

    def __init__(self, d: int, p: int, retraction=PolarRetraction):
        self.manifold = Stiefel(d, p, retraction)

    @staticmethod
    def projector(x: Tensor) -> Tensor:
        return x @ x.transpose(-1, -2)

    @staticmethod
    def point(basis: Tensor) -> Tensor:
        return basis


class SpherePCA:
    """Leading eigenvector only (p = 1): the point is ``u``, shape (d,), projector ``u u^T``."""

    gradient_rule = None

    def __init__(self, d: int, p: int, retraction=None):
        OptionsError.check(p == 1, "model.options.p", p, "the sphere parametrisation needs p = 1")
        self.manifold = Sphere(d)

    @staticmethod
    def projector(x: Tensor) -> Tensor:
        return torch.outer(x, x)

    @staticmethod
    def point(basis: Tensor) -> Tensor:
        return basis[:, 0]


PARAMETRISATIONS = {"grassmann": GrassmannPCA, "stiefel": StiefelPCA, "sphere": SpherePCA}


@dataclass
class Options(Checked):
    """Schema of ``model.options`` for ``model.name: fedpca``."""

    manifold: str = ranged("grassmann", one_of(PARAMETRISATIONS))
    p: Optional[int] = ranged(None, Rule(lambda v: v >= 1, "must be null (the data's p) or an integer >= 1"))


class FedPCA:
    """The federated PCA model (implements :class:`rfedray.task.FederatedModel`).

    Parameters
    ----------
    d, p : int
        Ambient dimension of the records and dimension of the subspace.
    parametrisation : class from :data:`PARAMETRISATIONS`
    dtype : torch.dtype
    """

    def __init__(self, d: int, p: int, parametrisation=GrassmannPCA, dtype: torch.dtype = torch.float32,
                 retraction=PolarRetraction):
        self.d, self.p, self.dtype = d, p, dtype
        self.parametrisation = parametrisation(d, p, retraction)
        self.groups = {GROUP: self.parametrisation.manifold}
        self.gradient_rule = self.parametrisation.gradient_rule

    def init_params(self, generator: torch.Generator) -> Params:
        point = self.parametrisation.manifold.random_point(generator=generator, dtype=torch.float64)
        return {GROUP: point.to(self.dtype)}

    def per_sample_loss(self, params: Params, z: Tensor) -> Tensor:
        """``-z^T P z`` for one record ``z`` of shape (d,)."""
        return -(z @ self.parametrisation.projector(params[GROUP]) @ z)

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        (cov,) = data.tensors
        cov = cov.to(torch.float64)
        proj = self.parametrisation.projector(params[GROUP].to(torch.float64))
        evals, evecs = torch.linalg.eigh(cov)
        top = evecs[:, -self.p:]
        optimum = top @ top.T
        loss = -torch.trace(proj @ cov)
        gap = loss + evals[-self.p:].sum()
        distance = torch.linalg.matrix_norm(proj - optimum) / 2 ** 0.5
        return {"loss": float(loss), "gap": float(gap), "distance": float(distance)}


def build(options: Options, info: dict, retraction=PolarRetraction) -> FedPCA:

    p = options.p if options.p is not None else info["p"]
    OptionsError.check(1 <= p < info["d"], "model.options.p", p, f"must be between 1 and d-1 ({info['d'] - 1})")
    dtype = DTYPES[info.get("dtype", "float32")]
    return FedPCA(info["d"], p, PARAMETRISATIONS[options.manifold], dtype, retraction)
