"""The private local step's gradient: per-sample tangent gradients, joint or group-wise clipping, ambient noise.

One private step of DP-RFedProj at ``theta`` on a minibatch ``b`` of ``B`` records drawn without
replacement::

    g = (1/B) sum_{l in b} clip_C(P_theta grad f(theta; z_l)) + P_theta xi,   xi ~ N(0, sigma^2 I),

with ``clip_C(v) = v min(1, C / ||v||)`` on the joint Frobenius norm of all parameter groups. The
tangent space carries the ambient metric, so the clipped average moves by at most ``2C/B`` when one
record is replaced, whatever ``theta``; projecting the ambient noise is post-processing. Hence each
step is ``C_q(G_mu0)``-DP with ``mu0 = 2C / (B sigma)`` and ``q = B / m``
(:mod:`rfedray.privacy.accountants`), provided the batch is drawn by :func:`sample_batch`.
Group-wise clipping (:class:`ClipShares`) clips each group to its own share of ``C`` instead, with the
clipped record's norm still at most ``C``: the same bound, the same accounting.

Only the privatised gradient leaves :func:`private_gradient`; per-sample gradients, norms and
clipping decisions are never returned or stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import Tensor
from torch.func import grad, vmap

from rfedray.geometry import ProductManifold
from rfedray.privacy import checks
from rfedray.privacy.randomness import SecureGenerator, seeded_or_fresh, subsets_and_normals

Params = dict[str, Tensor]
LossFn = Callable[..., Tensor]


class PerSampleRule(Protocol):
    """A model's closed-form algebra of per-record gradients (Opacus calls these grad samplers).

    The private step needs two things of the per-record gradients ``g_l = grad f(theta; z_l)``:
    their tangent norms (joint, or per group for group-wise clipping), to clip, and a weighted sum,
    to average. Since the tangent projection is
    linear, ``sum_l s_l P g_l = P (sum_l s_l g_l)``, so a model whose gradients have structure (a
    rank-one ``g_l = -z_l z_l^T`` for federated PCA) can give both without materialising ``B``
    gradients. :func:`private_gradient` then equals the generic ``vmap(grad)`` path to
    rounding; a wrong norm would break the sensitivity bound, so every rule is tested against it
    (``tests/test_mechanism.py``).

    Both methods broadcast over leading dimensions (several clients at once: parameters
    ``(K, *shape_g)``, records ``(K, B, ...)``), which :func:`rule_gradient` relies on.
    """

    def tangent_norms(self, params: Params, records: tuple[Tensor, ...]) -> Tensor:
        """``||P_theta g_l||`` joint over the groups, shape ``(..., B)``."""

    def group_tangent_norms(self, params: Params, records: tuple[Tensor, ...]) -> Params:
        """``||P_theta g_l||`` of each group on its own, ``{g: (..., B)}`` (for :class:`ClipShares`)."""

    def weighted_gradient(self, params: Params, records: tuple[Tensor, ...], weights: Tensor) -> Params:
        """``sum_l w_l g_l`` (ambient, not projected), ``{g: (..., *shape_g)}``; ``weights`` has shape
        ``(..., B)`` and a record with weight 0 contributes exactly 0, even if its values are not finite."""


@dataclass(frozen=True)
class ClipShares:
    """Group-wise clipping: each parameter group's tangent gradient clipped to its own share of ``C``.

    With shares ``s_g`` in (0, 1], ``sum_g s_g^2 = 1``, record ``l``'s tangent coordinates ``c_{l,g}`` in
    group ``g`` are clipped to ``C_g = s_g C``::

        clip(c_l)_g = c_{l,g} min(1, s_g C / ||c_{l,g}||),
        ||clip(c_l)||^2 = sum_g min(||c_{l,g}||, s_g C)^2 <= C^2 sum_g s_g^2 = C^2,

    so a clipped record still has norm at most ``C`` and replacing one record moves the clipped mean
    by at most ``2C/B``: the Gaussian step's sensitivity, hence its accounting and calibrated sigma,
    are those of joint clipping at ``C``. What changes is how ``C`` is spent: a group whose records
    have large gradients (an SPDNet's BiMap) no longer scales down the signal of a group with small
    ones (its head). This is Opacus's per-layer clipping (``DPPerLayerOptimizer``, ``clipping=
    "per_layer"`` with a list of per-layer ``max_grad_norm``, whose noise is calibrated to their
    Euclidean norm), here with the per-group bounds given as shares of the run's ``C``.

    Parameters
    ----------
    shares : tuple of (str, float)
        ``((group, s_g), ...)`` naming every group once (a tuple, so that a plan holding it is
        hashable); :meth:`of` builds it from a mapping.
    """

    shares: tuple[tuple[str, float], ...]

    TOLERANCE = 1e-9
    """How far ``sum_g s_g^2`` may be from 1 (rounding of shares written in decimal)."""

    def __post_init__(self) -> None:
        given = dict(self.shares)
        if not given or len(given) != len(self.shares):
            raise checks.PrivacyParameterError("clip_shares", given, "must name each parameter group once")
        for group, share in given.items():
            if not 0.0 < checks.real_number(f"clip_shares.{group}", share) <= 1.0:
                raise checks.PrivacyParameterError(f"clip_shares.{group}", share, "must be in (0, 1]")
        total = math.fsum(float(s) ** 2 for s in given.values())
        if abs(total - 1.0) > self.TOLERANCE:
            raise checks.PrivacyParameterError(
                "clip_shares", given,
                f"the squares of the shares must sum to 1 (within {self.TOLERANCE:g}; they sum to {total:.12g}), so that "
                "a clipped record's norm is at most C",
            )

    @classmethod
    def of(cls, shares: Mapping[str, float]) -> "ClipShares":
        """From ``{group: s_g}``."""
        return cls(tuple((str(g), float(s)) for g, s in shares.items()))

    def check_groups(self, groups: Sequence[str]) -> None:
        """Raise :class:`~rfedray.privacy.checks.PrivacyParameterError` (naming ``clip_shares``) unless
        the shares name exactly the model's ``groups``."""
        named = [g for g, _ in self.shares]
        unknown = [g for g in named if g not in groups]
        missing = [g for g in groups if g not in named]
        if unknown or missing:
            problem = f"unknown group {unknown[0]!r}" if unknown else f"no share for group {missing[0]!r}"
            raise checks.PrivacyParameterError(
                "clip_shares", dict(self.shares), f"{problem}; give a share to each of the model's groups: {', '.join(groups)}"
            )

    def bounds(self, clip: float) -> dict[str, float]:
        """``{g: C_g = s_g C}``."""
        return {g: s * clip for g, s in self.shares}

    def scales(self, norms: Mapping[str, Tensor], clip: float) -> dict[str, Tensor]:
        """Each record's clipping factor per group, ``min(1, C_g / ||c_{l,g}||)``, 0 for every group of a
        record with a non-finite norm in any group (a valid clipped value).

        Parameters
        ----------
        norms : dict of Tensor
            ``{g: (..., B)}`` the per-record tangent norms of each group.
        clip : float
            ``C``.

        Returns
        -------
        dict of Tensor
            ``{g: (..., B)}``.
        """
        finite = torch.stack([torch.isfinite(n) for n in norms.values()]).all(0)
        return {g: torch.where(finite, torch.clamp(c / norms[g], max=1.0), 0.0) for g, c in self.bounds(clip).items()}


def noise_generator(seed: Optional[int], device: str | torch.device = "cpu", context: Sequence[int] = ()) -> SecureGenerator:
    """The random generator of a client's batches and noise (:mod:`rfedray.privacy.randomness`).

    Parameters
    ----------
    seed : int or None
        ``None`` (production): a ChaCha20 keystream keyed by 256 bits of operating-system entropy,
        so the noise cannot be predicted from anything in the run. An integer in ``[0, 2^128)``
        fixes it (reproducible experiments only): the key is derived from the seed and ``context``.
    device : str or torch.device
        Where its draws are delivered: the device of the parameters.
    context : sequence of int
        Names the stream of a seeded generator, e.g. ``(client_id, round)``.

    Returns
    -------
    SecureGenerator
    """
    return seeded_or_fresh(seed, context, device)


def sample_batch(num_records: int, batch_size: int, generator: SecureGenerator) -> Tensor:
    """Exactly ``batch_size`` distinct record indices, uniformly without replacement.

    This is the sampling the accountants assume (never Poisson): every subset of size ``B`` is
    equally likely, so each record is in the batch with probability ``q = B / m``.

    Parameters
    ----------
    num_records : int
        ``m`` >= 1.
    batch_size : int
        ``B`` in [1, m].
    generator : SecureGenerator

    Returns
    -------
    Tensor
        int64 indices, shape ``(B,)``, on the generator's device.
    """
    batch_size, num_records = checks.batch_within(batch_size, num_records)
    return generator.subset(num_records, batch_size)


def per_sample_gradients(loss_fn: LossFn, params: Params, records: tuple[Tensor, ...]) -> Params:
    """Ambient gradient of ``loss_fn`` for every record, by ``torch.func.vmap(grad(loss_fn))``.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, *record) -> scalar`` for ONE record (no batch dimension).
    params : dict of Tensor
        ``{g: (*shape_g)}``.
    records : tuple of Tensor
        Each of shape ``(B, ...)``.

    Returns
    -------
    dict of Tensor
        ``{g: (B, *shape_g)}``.
    """
    in_dims = (None,) + (0,) * len(records)
    return vmap(grad(loss_fn), in_dims=in_dims)(params, *records)


def _check_records(records: tuple[Tensor, ...]) -> int:
    if len(records) == 0:
        raise checks.PrivacyParameterError("records", records, "must hold at least one tensor")
    size = int(records[0].shape[0]) if records[0].dim() > 0 else 0
    if size == 0 or any(r.dim() == 0 or r.shape[0] != size for r in records):
        raise checks.PrivacyParameterError(
            "records", tuple(tuple(r.shape) for r in records), "must share a leading batch dimension B >= 1"
        )
    return size


def standard_noise(product: ProductManifold, params: Params, generator: SecureGenerator) -> Params:
    """One standard Gaussian ambient draw per group, in float64, in the product's group order.

    The private step adds ``sigma`` times its tangent projection, scaled in float64 and only then
    cast to the model's dtype (a float32 draw would be a truncated Gaussian). A client draws its
    minibatch with :func:`sample_batch`, then this noise, from its own generator at every step.

    Parameters
    ----------
    product : ProductManifold
    params : dict of Tensor
        ``{g: (*shape_g)}``; the noise has their shapes (dtype float64) and device.
    generator : SecureGenerator
        Delivering on the device of ``params``.

    Returns
    -------
    dict of Tensor
        ``{g: (*shape_g)}`` float64, entries i.i.d. ``N(0, 1)``.
    """
    return {g: generator.standard_normal(params[g].shape) for g in product.groups}


def draw_step(
    num_records: Sequence[int], batch_size: int, product: Optional[ProductManifold], params: Params,
    generators: Sequence[SecureGenerator],
) -> tuple[Tensor, Optional[Params]]:
    """One step's randomness of K clients at once, each from its own generator: exactly what
    :func:`sample_batch` and then :func:`standard_noise` draw from that generator alone (the same
    words of its stream, the same bits, whatever the other generators of the call).

    Parameters
    ----------
    num_records : sequence of int
        ``m`` of every client (each checked with ``batch_size`` as by :func:`sample_batch`).
    batch_size : int
        ``B``.
    product : ProductManifold or None
        The groups of the noise, in the product's order; ``None``: no noise (the non-private step
        draws its minibatch only).
    params : dict of Tensor
        ``{g: (*shape_g)}``: the noise's shapes (float64 draws, delivered on the generators' device).
    generators : sequence of SecureGenerator
        The K clients' generators, delivering on one device.

    Returns
    -------
    index : Tensor
        int64, shape ``(K, B)``: row ``i`` is client ``i``'s minibatch.
    noise : dict of Tensor or None
        ``{g: (K, *shape_g)}`` float64 standard Gaussian; ``None`` without ``product``.
    """
    sizes = [checks.batch_within(batch_size, m)[1] for m in num_records]
    groups = list(product.groups) if product is not None else []
    index, normals = subsets_and_normals(generators, sizes, int(batch_size), [params[g].shape for g in groups])
    return index, dict(zip(groups, normals)) if product is not None else None


def scaled_noise(noise: Tensor, sigma: float, like: Tensor) -> Tensor:
    """``sigma * noise`` computed in float64 (or ``noise``'s dtype if wider), then cast to ``like``'s dtype."""
    return (sigma * noise).to(like.dtype)


def private_gradient(
    loss_fn: LossFn,
    params: Params,
    product: ProductManifold,
    records: tuple[Tensor, ...],
    *,
    clip: float,
    sigma: float,
    noise: Params,
    rule: Optional[PerSampleRule] = None,
    shares: Optional[ClipShares] = None,
) -> Params:
    """The privatised tangent gradient of one step on a minibatch.

    Per-sample gradients are measured and summed in each group's tangent coordinates
    (:meth:`~rfedray.geometry.Manifold.tangent_coordinates`, an isometric linear chart ``L`` of
    the tangent space), and mapped back once::

        c_l = L P grad f(theta; z_l),   s_l = min(1, C / ||c_l||),
        g = L^-1 ( sum_l s_l c_l / B + sigma L P xi ),

    which equals the clipped mean of the projected gradients plus the projected noise, because
    ``L`` is linear and keeps norms. On Gr(d, p) the coordinates take ``p d`` numbers per record
    instead of ``d^2``. With a model's ``rule`` (:class:`PerSampleRule`) no per-record gradient is
    formed::

        s_l = min(1, C / rule.tangent_norms_l),   g = P ( rule.weighted_gradient(s / B) + sigma xi ).

    With ``shares`` (:class:`ClipShares`) each group's coordinates are clipped on their own, to
    ``s_g C``: ``s_{l,g} = min(1, s_g C / ||c_{l,g}||)``.

    Nothing here draws random numbers (the noise is drawn by :func:`standard_noise` from the
    client's generator), so the function can be vmapped over clients.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, *record) -> scalar`` for one record (no batch dimension).
    params : dict of Tensor
        The current point ``theta``, ``{g: (*shape_g)}``.
    product : ProductManifold
        One factor per group of ``params``.
    records : tuple of Tensor
        The minibatch drawn by :func:`sample_batch`, each tensor of shape ``(B, ...)``.
    clip : float
        ``C`` > 0: bound on each record's joint tangent-gradient norm.
    sigma : float
        Absolute standard deviation > 0 of the ambient Gaussian noise added to every group (not a
        multiplier of ``C``).
    noise : dict of Tensor
        ``{g: (*shape_g)}``, standard Gaussian ambient noise (float64, :func:`standard_noise`; it is
        scaled by ``sigma`` before it is cast to the model's dtype).
    rule : PerSampleRule or None
        The model's closed-form per-record gradients (its ``gradient_rule``); ``None``: by
        ``vmap(grad(loss_fn))``.
    shares : ClipShares or None
        Group-wise clipping, each group to its share of ``C`` (the same sensitivity); ``None``: joint
        clipping at ``C``.

    Returns
    -------
    dict of Tensor
        ``{g: (*shape_g)}``, tangent at ``theta``.

    Notes
    -----
    A record whose gradient is not finite contributes zero (a valid clipped value: it stays within
    the ``2C/B`` sensitivity), so one degenerate record cannot turn the model into NaN.
    """
    clip = checks.positive("clip", clip)
    sigma = checks.positive("sigma", sigma)
    batch = _check_records(records)
    product.check_groups("noise", noise)
    if shares is not None:
        shares.check_groups(list(product.groups))
    if rule is not None:
        return rule_gradient(rule, params, product, records, clip=clip, sigma=sigma, noise=noise, batch_size=batch,
                             shares=shares)
    grads = per_sample_gradients(loss_fn, params, records)
    charts = {g: m.tangent_coordinates(params[g]) for g, m in product.groups.items()}
    coords = {g: charts[g].coordinates(grads[g]) for g in product.groups}
    if shares is None:
        flat = torch.cat([c.flatten(1) for c in coords.values()], dim=1)  # (B, sum of the groups' coordinates)
        norms = torch.linalg.vector_norm(flat, dim=1)
        finite = torch.isfinite(norms)
        scale = torch.where(finite, torch.clamp(clip / norms, max=1.0), 0.0) / batch
        total = torch.tensordot(scale, torch.where(finite[:, None], flat, 0.0), dims=1)
        parts = dict(zip(coords, torch.split(total, [c[0].numel() for c in coords.values()])))
    else:
        flats = {g: c.flatten(1) for g, c in coords.items()}  # {g: (B, the group's coordinates)}
        scales = shares.scales({g: torch.linalg.vector_norm(f, dim=1) for g, f in flats.items()}, clip)
        parts = {g: torch.tensordot(scales[g] / batch, torch.where(scales[g][:, None] != 0, f, 0.0), dims=1)
                 for g, f in flats.items()}
    return {
        g: charts[g].vector(part.view(coords[g].shape[1:]) + charts[g].coordinates(scaled_noise(noise[g], sigma, part)))
        for g, part in parts.items()
    }


def rule_gradient(
    rule: PerSampleRule,
    params: Params,
    product: ProductManifold,
    records: tuple[Tensor, ...],
    *,
    clip: float,
    sigma: float,
    noise: Params,
    batch_size: int,
    shares: Optional[ClipShares] = None,
) -> Params:
    """:func:`private_gradient` through a model's :class:`PerSampleRule`, over any
    leading dimensions::

        s_l = min(1, C / ||P g_l||) (0 if not finite),   g = P ( sum_l (s_l / B) g_l + sigma xi ),

    or, with ``shares``, group ``g``'s part of ``sum_l (s_{l,g} / B) g_l`` with
    ``s_{l,g} = min(1, s_g C / ||P g_{l,g}||)`` (one weighted sum per group).

    Several clients' steps are one call with a leading client dimension on ``params``, ``records``
    and ``noise``, without ``vmap`` (:func:`rfedray.federated.client.train_together`); every operation computes each
    client's slice as it would alone. Arguments are not checked here (the callers have).

    Parameters
    ----------
    rule : PerSampleRule
    params : dict of Tensor
        ``{g: (..., *shape_g)}``.
    product : ProductManifold
    records : tuple of Tensor
        Each ``(..., B, ...)``.
    clip, sigma : float
    noise : dict of Tensor
        ``{g: (..., *shape_g)}`` standard Gaussian (float64: scaled, then cast).
    batch_size : int
        ``B``.
    shares : ClipShares or None
        Group-wise clipping (checked against the groups by the caller); ``None``: joint.

    Returns
    -------
    dict of Tensor
        ``{g: (..., *shape_g)}``, tangent at ``params``.
    """
    if shares is None:
        norms = rule.tangent_norms(params, records)
        scale = torch.where(torch.isfinite(norms), torch.clamp(clip / norms, max=1.0), 0.0) / batch_size
        total = rule.weighted_gradient(params, records, scale)
    else:
        scales = shares.scales(rule.group_tangent_norms(params, records), clip)
        total = {g: rule.weighted_gradient(params, records, scales[g] / batch_size)[g] for g in product.groups}
    return product.proj_tangent(params, {g: total[g] + scaled_noise(noise[g], sigma, total[g]) for g in product.groups})


def nonprivate_gradient(
    loss_fn: LossFn, params: Params, product: ProductManifold, records: tuple[Tensor, ...]
) -> Params:
    """The tangent-projected mean gradient of a minibatch (the non-private baseline).

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, *record) -> scalar`` for one record.
    params : dict of Tensor
        ``{g: (*shape_g)}``.
    product : ProductManifold
    records : tuple of Tensor
        Each of shape ``(B, ...)``.

    Returns
    -------
    dict of Tensor
        ``P_theta`` of the gradient of the mean loss, ``{g: (*shape_g)}``.
    """
    _check_records(records)
    in_dims = (None,) + (0,) * len(records)

    def mean_loss(p: Params) -> Tensor:
        return vmap(loss_fn, in_dims=in_dims)(p, *records).mean()

    return product.proj_tangent(params, grad(mean_loss)(params))
