"""The DDP-SA client step: layer-wise L1 clipping, Laplace noise, clipping-threshold policies.

A step on a minibatch of ``B`` records: per-record gradients (``torch.func.vmap`` through
:func:`rfedray.privacy.mechanism.per_sample_gradients`), for every layer ``l`` (parameters grouped
by the name before the first dot: ``layer0.weight`` and ``layer0.bias`` form ``layer0``; a
linear model's ``weight`` and ``bias`` are two layers) the per-record gradient is clipped to L1
norm ``C_l``, averaged, and Laplace noise of scale ``b_l = z 2 C_l / B`` is added to every
coordinate. L1, not L2: the Laplace mechanism is calibrated to the L1 sensitivity ``2 C_l / B``.

Where the thresholds ``C_l`` come from is a :class:`ClipPolicy`:

- :class:`StaticClip`: one fixed ``C`` for every layer and round (the DDP-SA baseline).
- :class:`MedianClip`: DDP-SA-adaptive as published: every client sets ``C_l`` to the median of
  its batch's per-record L1 norms of layer ``l``, each round. **The median is computed from the
  private records and never privatised: the noise scale (visible in the update) depends on it, so
  this variant is NOT covered by the record-level guarantee**; the epsilon reported for it is the
  nominal one (as if the thresholds were public).
- :class:`PrivateQuantileClip`: the covered variant. Each client keeps per-layer thresholds and
  updates them by the geometric rule of Andrew et al. (2021),
  ``C_l <- C_l exp(-eta (f~_l - gamma))`` with ``f~_l`` a Laplace-privatised fraction of the
  batch's records whose layer-``l`` norm is at most ``C_l``; the counts are a release charged to
  the ledger (each count has sensitivity 1, Laplace scale ``b_c``, ratio ``L / b_c`` for ``L``
  layers: a share ``phi`` of the step's budget), and the thresholds are post-processing of them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import Tensor

from rfedray.privacy import checks
from rfedray.privacy.mechanism import per_sample_gradients
from rfedray.privacy.randomness import SecureGenerator
from rfedray.task import Params


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its name before the first dot."""
    return name.split(".", 1)[0]


def layers_of(names) -> dict[str, list[str]]:
    """``{layer: [parameter names]}`` in parameter order."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(layer_of(name), []).append(name)
    return out


def laplace_noise(shape, scale: float, generator: SecureGenerator, dtype: torch.dtype) -> Tensor:
    """Laplace(0, scale) noise drawn in float64 (:meth:`SecureGenerator.laplace`), cast to ``dtype``."""
    return generator.laplace(tuple(shape), scale).to(dtype)


def layer_l1_norms(grads: Params, layers: dict[str, list[str]]) -> dict[str, Tensor]:
    """Per-record L1 norm of every layer's gradient, each of shape ``(B,)``."""
    return {l: sum(grads[n].flatten(1).abs().sum(1) for n in names) for l, names in layers.items()}


class ClipPolicy(ABC):
    """Chooses the per-layer clip thresholds of a step, and says what that choice costs."""

    name: str
    covered: bool = True

    @abstractmethod
    def thresholds(self, state: dict, norms: dict[str, Tensor]) -> dict[str, float]:
        """``{layer: C_l}`` for this step (``state`` is the client's own, kept between rounds)."""

    def after_release(self, state: dict, norms: dict[str, Tensor], clips: dict[str, float],
                      generator: SecureGenerator) -> dict:
        """Further releases of the step (e.g. noisy counts); returns diagnostics."""
        return {}

    budget_share: float = 0.0
    """Fraction of every step's privacy ratio spent on the policy's own releases."""

    def bind(self, noise_multiplier: float) -> "ClipPolicy":
        """The policy with its own noise set for gradient noise multiplier ``z`` (identity here)."""
        return self

    def describe(self) -> dict:
        return {"clipping": self.name, "covered_by_guarantee": self.covered}


@dataclass
class StaticClip(ClipPolicy):
    """The same L1 clip ``C`` for every layer (DDP-SA)."""

    clip: float = 1.0
    name: str = "static"

    def __post_init__(self):
        checks.positive("clip", self.clip)

    def thresholds(self, state, norms):
        return {l: self.clip for l in norms}

    def describe(self):
        return {**super().describe(), "clip": self.clip}


@dataclass
class MedianClip(ClipPolicy):
    """DDP-SA-adaptive as published: ``C_l`` = median of the batch's per-record L1 norms.

    NOT covered by the record-level guarantee (the median is an unprivatised function of the
    records that sets the noise scale). ``floor`` keeps a threshold positive.
    """

    floor: float = 1e-6
    name: str = "median"
    covered: bool = False

    def thresholds(self, state, norms):
        return {l: max(float(v.median()), self.floor) for l, v in norms.items()}


@dataclass
class PrivateQuantileClip(ClipPolicy):
    """Per-layer thresholds tracking the ``target_quantile`` of the norms through noisy counts.

    Attributes
    ----------
    initial_clip : float
        Every layer's threshold before the first update, > 0.
    target_quantile : float
        gamma in (0, 1); 0.5 tracks the median like the published method.
    learning_rate : float
        eta > 0 of the geometric update.
    budget_share : float
        phi in (0, 1): the counts get the fraction phi of each step's ratio, the gradient ``1 - phi``,
        i.e. ``b_c = z (1 - phi) / phi`` (set by :meth:`bind`).
    count_scale : float or None
        Laplace scale ``b_c`` of every noisy count; ``None`` until bound.
    """

    initial_clip: float = 1.0
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    budget_share: float = 0.1
    count_scale: Optional[float] = None
    name: str = "private_quantile"

    def __post_init__(self):
        checks.positive("initial_clip", self.initial_clip)
        checks.open_unit("target_quantile", self.target_quantile)
        checks.positive("learning_rate", self.learning_rate)
        checks.open_unit("budget_share", self.budget_share)
        if self.count_scale is not None:
            checks.positive("count_scale", self.count_scale)

    def bind(self, noise_multiplier):
        return replace(self, count_scale=noise_multiplier * (1 - self.budget_share) / self.budget_share)

    def thresholds(self, state, norms):
        clips = state.setdefault("clips", {})
        return {l: clips.setdefault(l, self.initial_clip) for l in norms}

    def after_release(self, state, norms, clips, generator):
        if self.count_scale is None:
            raise ValueError("count_scale=None: bind the policy to the noise multiplier first")
        fractions = {}
        for l, v in norms.items():
            count = float((v <= clips[l]).sum()) + float(laplace_noise((), self.count_scale, generator, torch.float64))
            # Clamping the released fraction to [0, 1] is post-processing (free) and bounds each
            # round's multiplicative change, so heavy count noise cannot make the thresholds diverge.
            fractions[l] = min(1.0, max(0.0, count / v.shape[0]))
            state["clips"][l] = clips[l] * math.exp(-self.learning_rate * (fractions[l] - self.target_quantile))
        return {"noisy_fraction_below": fractions}

    def describe(self):
        return {**super().describe(), "initial_clip": self.initial_clip, "target_quantile": self.target_quantile,
                "learning_rate": self.learning_rate, "budget_share": self.budget_share, "count_scale": self.count_scale}


@dataclass
class StepRelease:
    """What a DDP-SA step produced on a client: the privatised gradient and diagnostics."""

    gradient: Params
    clips: dict[str, float]
    noise_scales: dict[str, float]
    diagnostics: dict = field(default_factory=dict)


def ddpsa_step(loss, params: Params, batch: tuple[Tensor, ...], policy: ClipPolicy, state: dict,
               noise_multiplier: Optional[float], generator: SecureGenerator) -> StepRelease:
    """One DDP-SA step (see the module docstring); ``noise_multiplier=None`` adds no noise.

    Only the privatised gradient is meant to leave the client; ``clips`` and ``noise_scales``
    are simulation telemetry (for :class:`MedianClip` they are unprivatised functions of the
    records).
    """
    grads = per_sample_gradients(loss, params, batch)
    layers = layers_of(params)
    norms = layer_l1_norms(grads, layers)
    clips = policy.thresholds(state, norms)
    size = int(batch[0].shape[0])
    out: Params = {}
    scales: dict[str, float] = {}
    for l, names in layers.items():
        factor = (clips[l] / norms[l].clamp_min(1e-30)).clamp(max=1.0)
        factor = torch.where(torch.isfinite(norms[l]), factor, torch.zeros_like(factor))
        scales[l] = 0.0 if noise_multiplier is None else noise_multiplier * 2.0 * clips[l] / size
        for n in names:
            g = grads[n]
            mean = (torch.nan_to_num(g) * factor.reshape((-1,) + (1,) * (g.dim() - 1))).sum(0) / size
            if noise_multiplier is not None:
                mean = mean + laplace_noise(mean.shape, scales[l], generator, mean.dtype)
            out[n] = mean
    diagnostics = policy.after_release(state, norms, clips, generator) if noise_multiplier is not None else {}
    return StepRelease(out, clips, scales, diagnostics)
