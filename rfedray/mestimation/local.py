"""The private client computations of the M-estimation strategies.

One private *step* releases, from a minibatch of ``B`` records drawn without replacement, either
a Gaussian-privatised gradient (:func:`rfedray.privacy.mechanism.private_gradient`: per-record
clip ``C``, noise ``sigma = z C``), or, for a Newton step, the pair

    g~ = (1/B) sum_l clip_{C_g}(grad f(theta; z_l)) + N(0, sigma_g^2 I)
    H~ = sym((1/B) sum_l clip_{C_H}(hess f(theta; z_l)) + N(0, sigma_H^2 I_{P x P}))

with the per-record Hessian clipped in Frobenius norm. Accounting the pair as one Gaussian
mechanism: scaling ``H~`` by ``sigma_g / sigma_H`` (post-processing, invertible) gives a vector
``(g~, H~')`` whose clipped part has per-record norm at most
``C_eff = sqrt(C_g^2 + (C_H sigma_g / sigma_H)^2)`` and whose noise is isotropic ``N(0, sigma_g^2)``:
one Gaussian mechanism with clip ``C_eff`` and std ``sigma_g`` (``mu0 = 2 C_eff / (B sigma_g)``).
The strategies use ``sigma_g = sqrt(2) z C_g`` and ``sigma_H = sqrt(2) z C_H``, so that
``C_eff / sigma_g = 1 / z``: a Newton step costs exactly one gradient step of noise multiplier ``z``,
and the ledger composes identical steps. Symmetrising and the eigenvalue floor that keeps ``H~``
positive definite are post-processing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from rfedray.geometry import Euclidean, ProductManifold
from rfedray.privacy.mechanism import nonprivate_gradient, private_gradient, sample_batch, scaled_noise, standard_noise
from rfedray.privacy.randomness import SecureGenerator
from rfedray.task import Params

PAIR_FACTOR = math.sqrt(2.0)
"""Noise inflation of each half of a Newton pair so the pair costs one step of multiplier ``z``."""


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets to move between a parameter dict and one flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, params: Params) -> "ParamLayout":
        return cls(tuple(params), tuple(tuple(v.shape) for v in params.values()))

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def flatten(self, params: Params) -> Tensor:
        return torch.cat([params[n].reshape(-1) for n in self.names])

    def unflatten(self, vec: Tensor) -> Params:
        return {n: chunk.reshape(s) for n, s, chunk in zip(self.names, self.shapes, torch.split(vec, self.sizes))}


def euclidean_product(params: Params) -> ProductManifold:
    """The flat product manifold of a Euclidean model's parameters."""
    return ProductManifold({name: Euclidean(*value.shape) for name, value in params.items()})


def step_gradient(loss: Callable, params: Params, batch: tuple[Tensor, ...], clip: float,
                  sigma: Optional[float], generator: SecureGenerator) -> Params:
    """The project's Gaussian mechanism on the clipped mean gradient (non-private when ``sigma`` is None)."""
    product = euclidean_product(params)
    if sigma is None:
        return nonprivate_gradient(loss, params, product, batch)
    noise = standard_noise(product, params, generator)
    return private_gradient(loss, params, product, batch, clip=clip, sigma=sigma, noise=noise)


class VmapHessian:
    """Per-record Hessians of any model by ``vmap(jacrev(grad(loss)))`` over chunks of records.

    The fallback of :func:`private_hessian` for models without closed-form Hessians (memory
    ``chunk_size * P^2``).
    """

    def __init__(self, loss: Callable, params: Params, chunk_size: int = 32):
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
        self.layout = ParamLayout.of(params)
        self.chunk_size = chunk_size
        layout = self.layout

        def flat_loss(vec: Tensor, *record: Tensor) -> Tensor:
            return loss(layout.unflatten(vec), *record)

        self._flat_loss = flat_loss

    def _chunks(self, params: Params, batch: tuple[Tensor, ...]):
        flat = self.layout.flatten(params).detach()
        per_record = torch.func.vmap(torch.func.jacrev(torch.func.grad(self._flat_loss)),
                                     in_dims=(None,) + (0,) * len(batch))
        for start in range(0, int(batch[0].shape[0]), self.chunk_size):
            yield start, per_record(flat, *(t[start:start + self.chunk_size] for t in batch))

    def per_sample_hessian_norms(self, params: Params, *batch: Tensor) -> Tensor:
        return torch.cat([torch.linalg.matrix_norm(h) for _, h in self._chunks(params, batch)])

    def weighted_hessian_sum(self, params: Params, weights: Tensor, *batch: Tensor) -> Tensor:
        total = torch.zeros(self.layout.size, self.layout.size, dtype=weights.dtype)
        for start, h in self._chunks(params, batch):
            total = total + torch.einsum("b,bij->ij", weights[start:start + h.shape[0]], h)
        return total


def private_hessian(model, params: Params, batch: tuple[Tensor, ...], clip: float, sigma: Optional[float],
                    generator: SecureGenerator, chunk_size: int = 32) -> Tensor:
    """``sym(mean of Frobenius-clipped per-record Hessians + N(0, sigma^2))``, shape ``(P, P)``.

    A record whose Hessian is not finite (e.g. a finite but huge record whose Hessian overflows)
    contributes zero, a valid clipped value, as in :func:`~rfedray.privacy.mechanism.private_gradient`:
    one record can neither turn the release into NaN nor reveal through it that it was sampled.

    Per-record Hessians come from the model's closed form when it has one
    (``per_sample_hessian_norms`` and ``weighted_hessian_sum``, e.g. the GLMs of
    :mod:`rfedray.models.logreg`), else from :class:`VmapHessian`.

    Parameters
    ----------
    model : FederatedModel
    params : dict of Tensor
    batch : tuple of Tensor
        Records with the batch as leading dimension.
    clip : float
        Frobenius clip ``C_H`` > 0.
    sigma : float or None
        Noise std of every entry; ``None``: no noise and no clipping (the non-private baseline).
    generator : SecureGenerator
    chunk_size : int
        Records per vmapped chunk of the fallback.
    """
    if clip <= 0:
        raise ValueError(f"clip={clip}: must be > 0")
    source = model if hasattr(model, "weighted_hessian_sum") else VmapHessian(model.per_sample_loss, params, chunk_size)
    size = int(batch[0].shape[0])
    dtype = next(iter(params.values())).dtype
    if sigma is None:
        weights = torch.full((size,), 1.0 / size, dtype=dtype)
    else:
        norms = source.per_sample_hessian_norms(params, *batch)
        finite = torch.isfinite(norms)
        weights = torch.where(finite, (clip / norms.clamp_min(1e-30)).clamp(max=1.0), 0.0) / size
        # A record whose Hessian is not finite contributes exactly zero, as in private_gradient: its
        # values are replaced by zeros before the weighted sum (0 * inf would be NaN).
        batch = tuple(torch.where(finite.view(-1, *(1,) * (t.dim() - 1)), t, torch.zeros_like(t)) for t in batch)
    mean = source.weighted_hessian_sum(params, weights, *batch)
    if sigma is not None:
        mean = mean + scaled_noise(generator.standard_normal(mean.shape), sigma, mean)
    return 0.5 * (mean + mean.mT)


def newton_direction(hessian: Tensor, gradient: Tensor, floor: float) -> Tensor:
    """``H+^{-1} g`` with ``H+`` the symmetric ``hessian`` with eigenvalues raised to ``floor`` (> 0)."""
    if floor <= 0:
        raise ValueError(f"floor={floor}: must be > 0 to keep the Hessian positive definite")
    evals, evecs = torch.linalg.eigh(hessian)
    return evecs @ ((evecs.mT @ gradient) / evals.clamp_min(floor))


@dataclass(frozen=True)
class StepPlan:
    """The public parameters of every private step (identical across clients).

    Attributes
    ----------
    batch_size : int
        B, records per step (drawn without replacement).
    clip : float
        Gradient clip C (C_g in a Newton step).
    noise_multiplier : float or None
        z: the gradient noise std is ``z C``; ``None`` runs without privacy.
    noise_seed : int or None
        ``None``: OS entropy. An integer makes runs reproducible (not for production).
    """

    batch_size: int
    clip: float
    noise_multiplier: Optional[float]
    noise_seed: Optional[int] = None

    def sigma(self, clip: float, factor: float = 1.0) -> Optional[float]:
        return None if self.noise_multiplier is None else factor * self.noise_multiplier * clip

    def batch(self, data: tuple[Tensor, ...], generator: SecureGenerator) -> tuple[Tensor, ...]:
        m = int(data[0].shape[0])
        index = sample_batch(m, min(self.batch_size, m), generator)
        return tuple(t[index] for t in data)
