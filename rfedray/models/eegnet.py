"""EEGNet-8,2 (Lawhern et al., 2018) on raw EEG trials, with per-sample-safe normalisation.

Layers, for a trial of shape ``(C, T)`` (F1 = 8 temporal filters, depth multiplier D = 2,
F2 = 16; sizes for T = 513 in brackets)::

    temporal conv   1 -> F1, kernel (1, 64), 'same', no bias       (8, C, T)
    GroupNorm
    depthwise conv  F1 -> F1 D, kernel (C, 1), per filter, no bias (16, 1, T)
    GroupNorm, ELU, average pool (1, 4)                            (16, 1, T // 4)     [128]
    separable conv  depthwise (1, 16) 'same' + pointwise 1x1, no biases
    GroupNorm, ELU, average pool (1, 8)                            (16, 1, T // 32)    [16]
    linear          F2 (T // 32) -> K, with bias

Differences with the original, all for record-level DP:

- BatchNorm mixes the records of a batch, so a record's gradient would depend on the others; it
  is replaced by GroupNorm (statistics of one record). The norms have no affine parameters, so
  the parameter count is ``8 * 64 + 16 C + 16 * 16 + 16 * 16 + K (16 (T // 32) + 1)``, which is
  Table 13's count: 2,404 for BNCI2014_001 (C = 22, T = 513, K = 4), 2,434 for Cho2017 (64, 384,
  2) and 3,783 for Weibo2014 (60, 513, 7). By default one group per norm (``norm_groups = 1``):
  statistics over all feature maps of the record, which keeps the relative power of the spatial
  filters (the motor-imagery signal); one group per map would normalise each filter's power away.
  Inputs must be in microvolts, as :mod:`rfedray.data.eeg` gives them: the norms then make the
  network invariant to the input scale, whereas volt-scale variances (~1e-10) would be swamped by
  GroupNorm's eps (1e-5).
- Dropout is left out of the loss: the private step vmaps one deterministic per-record loss, and
  the DP noise regularises; faithful per-record dropout masks would need
  ``vmap(randomness="different")`` in the core.
- No max-norm weight constraints (clipping bounds every per-record update instead).

The network is a :class:`torch.nn.Module` evaluated through :func:`torch.func.functional_call`;
its parameters are one Euclidean group ``"net"``, a flat vector that is viewed as the module's
tensors (the talk: "all free and Euclidean, one optimiser").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from rfedray.options import DTYPES, Checked, OptionsError, Rule, ranged
from rfedray.geometry import Euclidean
from rfedray.models.spdnet import classification_metrics
from rfedray.task import EvalData, Params

GROUP = "net"


def same_padding(length: int) -> tuple[int, int, int, int]:
    """Zero padding (left, right, top, bottom) that keeps the time length, as Keras' 'same'."""
    return ((length - 1) // 2, length // 2, 0, 0)


class EEGNetModule(nn.Module):
    """The EEGNet layers (see the module docstring); input ``(N, 1, C, T)``, output ``(N, K)``.

    Parameters
    ----------
    channels, n_times, num_classes : int
        ``C``, ``T`` and ``K``.
    f1, depth_multiplier, f2 : int
        EEGNet's F1, D and F2.
    kernel_length, separable_length : int
        Temporal kernel lengths of the first and of the separable convolution.
    pool1, pool2 : int
        Average-pooling widths.
    norm_groups : int
        Groups of every GroupNorm; must divide ``f1``, ``f1 * depth_multiplier`` and ``f2``.
    """

    def __init__(
        self,
        channels: int,
        n_times: int,
        num_classes: int,
        f1: int = 8,
        depth_multiplier: int = 2,
        f2: int = 16,
        kernel_length: int = 64,
        separable_length: int = 16,
        pool1: int = 4,
        pool2: int = 8,
        norm_groups: int = 1,
    ):
        super().__init__()
        f12 = f1 * depth_multiplier
        if n_times // (pool1 * pool2) < 1:
            raise ValueError(f"n_times={n_times!r}: must be >= pool1 * pool2 ({pool1 * pool2})")
        if any(width % norm_groups for width in (f1, f12, f2)):
            raise ValueError(f"norm_groups={norm_groups!r}: must divide f1 ({f1}), f1 * D ({f12}) and f2 ({f2})")
        self.pad_temporal = nn.ZeroPad2d(same_padding(kernel_length))
        self.temporal = nn.Conv2d(1, f1, (1, kernel_length), bias=False)
        self.norm1 = nn.GroupNorm(norm_groups, f1, affine=False)
        self.spatial = nn.Conv2d(f1, f12, (channels, 1), groups=f1, bias=False)
        self.norm2 = nn.GroupNorm(norm_groups, f12, affine=False)
        self.pool1 = nn.AvgPool2d((1, pool1))
        self.pad_separable = nn.ZeroPad2d(same_padding(separable_length))
        self.separable_depth = nn.Conv2d(f12, f12, (1, separable_length), groups=f12, bias=False)
        self.separable_point = nn.Conv2d(f12, f2, 1, bias=False)
        self.norm3 = nn.GroupNorm(norm_groups, f2, affine=False)
        self.pool2 = nn.AvgPool2d((1, pool2))
        self.classifier = nn.Linear(f2 * (n_times // (pool1 * pool2)), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(self.temporal(self.pad_temporal(x)))
        x = self.pool1(F.elu(self.norm2(self.spatial(x))))
        x = self.pool2(F.elu(self.norm3(self.separable_point(self.separable_depth(self.pad_separable(x))))))
        return self.classifier(x.flatten(1))


def fan_in(name: str, module: nn.Module) -> int:
    """Fan-in of the layer owning parameter ``name`` (weights and biases alike)."""
    weight = module.get_parameter(name.rsplit(".", 1)[0] + ".weight")
    return math.prod(weight.shape[1:])


class EEGNet:
    """EEGNet as a :class:`rfedray.task.FederatedModel` with one flat Euclidean group ``"net"``.

    Parameters
    ----------
    channels, n_times, num_classes : int
        ``C``, ``T`` and ``K`` of the raw trials.
    norm_groups : int
        Groups of the GroupNorm layers.
    dtype : torch.dtype
        Of the parameters; inputs are cast to it.
    """

    gradient_rule = None
    """Per-record gradients by ``vmap(grad)`` (no closed form: see :class:`~rfedray.privacy.mechanism.PerSampleRule`)."""

    def __init__(self, channels: int, n_times: int, num_classes: int, norm_groups: int = 1, dtype: torch.dtype = torch.float32):
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r}: must be an integer >= 2")
        self.channels, self.n_times, self.num_classes, self.dtype = channels, n_times, num_classes, dtype
        self.module = EEGNetModule(channels, n_times, num_classes, norm_groups=norm_groups).to(dtype)
        self.layout = [(name, tuple(p.shape)) for name, p in self.module.named_parameters()]
        self.sizes = [math.prod(shape) for _, shape in self.layout]
        self.fan_ins = [fan_in(name, self.module) for name, _ in self.layout]
        self.groups = {GROUP: Euclidean(sum(self.sizes))}

    @property
    def num_parameters(self) -> int:
        return sum(self.sizes)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of the flat parameter vector (shape ``(P,)``) as the module's named tensors."""
        return {name: part.view(shape) for (name, shape), part in zip(self.layout, torch.split(flat, self.sizes))}

    def init_params(self, generator: torch.Generator) -> Params:
        """PyTorch's default initialisation: every tensor ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
        parts = [
            (2 * torch.rand(size, generator=generator, dtype=torch.float64) - 1) / math.sqrt(fan)
            for size, fan in zip(self.sizes, self.fan_ins)
        ]
        return {GROUP: torch.cat(parts).to(self.dtype)}

    def logits(self, params: Params, x: Tensor) -> Tensor:
        """Class scores of raw trials ``x`` of shape ``(..., C, T)``: ``(..., K)``."""
        lead = x.shape[:-2]
        inputs = x.to(self.dtype).reshape(-1, 1, self.channels, self.n_times)
        out = functional_call(self.module, self.unflatten(params[GROUP]), (inputs,))
        return out.reshape(*lead, self.num_classes)

    def per_sample_loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """Cross-entropy of one trial ``x`` of shape ``(C, T)`` with integer label ``y`` of shape ``()``."""
        return F.cross_entropy(self.logits(params, x), y)

    def evaluate(self, params: Params, data: EvalData, chunk: int = 64) -> dict[str, float]:
        """Accuracy and mean cross-entropy on ``data.tensors = (x, y)``, ``x`` of shape ``(n, C, T)``."""
        return classification_metrics(self.logits, params, data, chunk)


@dataclass
class Options(Checked):
    """Schema of ``model.options`` for ``model.name: eegnet``.

    Attributes
    ----------
    norm_groups : int
        Groups of every GroupNorm (1, 2, 4 or 8: a divisor of F1 = 8).
    """

    norm_groups: int = ranged(1, Rule(lambda v: v in (1, 2, 4, 8), "must be 1, 2, 4 or 8 (a divisor of F1 = 8)"))


def build(options: Options, info: dict, retraction=None) -> EEGNet:
    """Build EEGNet; ``retraction`` is accepted for a uniform signature (all groups are Euclidean)."""
    """EEGNet for raw trials described by ``info`` (``channels``, ``n_times``, ``num_classes``, ``dtype``)."""
    if info.get("representation", "raw") != "raw":
        raise OptionsError("data.options.representation", info["representation"], "EEGNet needs raw trials")
    return EEGNet(info["channels"], info["n_times"], info["num_classes"], options.norm_groups, DTYPES[info.get("dtype", "float32")])
