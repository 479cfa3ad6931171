"""A small multilayer perceptron on a Euclidean parameter space (classification or regression).

Parameters are one Euclidean group per tensor, ``layer{i}.weight`` of shape ``(out, in)`` and
``layer{i}.bias`` of shape ``(out,)``; layer-wise mechanisms (DDP-SA-adaptive) group them by the
prefix before the dot. Hidden layers use ``tanh`` (smooth, so Newton-type strategies have a
Hessian). No normalisation layer: per-sample gradients stay independent across records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rfedray.options import NON_NEGATIVE, Checked, Rule, one_of, ranged
from rfedray.geometry import Euclidean
from rfedray.models.logreg import (
    TASKS, classification_metrics, cross_entropy, model_dtype, parameter_error, regression_metrics, ridge,
    squared_error, task_of,
)
from rfedray.task import EvalData, Params

ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


class MLP:
    """``x -> W_L act(... act(W_1 x + b_1) ...) + b_L``.

    Parameters
    ----------
    num_features : int
    hidden : sequence of int
        Widths of the hidden layers (empty: a linear model).
    num_outputs : int
        Classes (classification) or 1 (regression).
    task : {"classification", "regression"}
    activation : {"tanh", "relu"}
    l2 : float
        Ridge coefficient in every record's loss.
    dtype : torch.dtype
    """

    gradient_rule = None
    """Per-record gradients by ``vmap(grad)`` (no closed form: see :class:`~rfedray.privacy.mechanism.PerSampleRule`)."""

    def __init__(self, num_features: int, hidden: list[int], num_outputs: int, task: str = "classification",
                 activation: str = "tanh", l2: float = 0.0, dtype: torch.dtype = torch.float64):
        if task not in ("classification", "regression"):
            raise ValueError(f"task={task!r}: must be classification or regression")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: must be one of {', '.join(ACTIVATIONS)}")
        if num_features < 1 or num_outputs < 1 or any(h < 1 for h in hidden):
            raise ValueError(f"num_features={num_features}, hidden={hidden}, num_outputs={num_outputs}: sizes must be >= 1")
        if l2 < 0:
            raise ValueError(f"l2={l2}: must be >= 0")
        self.task, self.l2, self.dtype = task, l2, dtype
        self.activation = ACTIVATIONS[activation]
        self.widths = [num_features, *hidden, num_outputs]
        self.groups = {}
        for i, (fan_in, fan_out) in enumerate(zip(self.widths[:-1], self.widths[1:])):
            self.groups[f"layer{i}.weight"] = Euclidean(fan_out, fan_in)
            self.groups[f"layer{i}.bias"] = Euclidean(fan_out)
        self.num_layers = len(self.widths) - 1

    def init_params(self, generator: torch.Generator) -> Params:
        """Glorot-uniform weights, zero biases."""
        params = {}
        for i, (fan_in, fan_out) in enumerate(zip(self.widths[:-1], self.widths[1:])):
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            w = (torch.rand(fan_out, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            params[f"layer{i}.weight"] = w.to(self.dtype)
            params[f"layer{i}.bias"] = torch.zeros(fan_out, dtype=self.dtype)
        return params

    def forward(self, params: Params, x: Tensor) -> Tensor:
        h = x
        for i in range(self.num_layers):
            h = h @ params[f"layer{i}.weight"].mT + params[f"layer{i}.bias"]
            if i < self.num_layers - 1:
                h = self.activation(h)
        return h

    def per_sample_loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        out = self.forward(params, x)
        data_loss = cross_entropy(out, y) if self.task == "classification" else squared_error(out, y)
        return data_loss + ridge(params, self.l2)

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        x, y = data.tensors
        with torch.no_grad():
            out = self.forward(params, x.to(self.dtype))
        if self.task == "classification":
            return classification_metrics(out, y)
        metrics = regression_metrics(out, y)
        if "optimum" in data.extra and self.num_layers == 1:
            metrics["param_error"] = parameter_error({"weight": params["layer0.weight"], "bias": params["layer0.bias"]},
                                                     data.extra["optimum"])
        return metrics


@dataclass
class Options(Checked):
    """Schema of ``model.options`` for ``model.name: mlp``.

    Attributes
    ----------
    hidden : list of int
        Hidden widths.
    activation : {"tanh", "relu"}
    task : {"auto", "classification", "regression"}
    l2 : float
    """

    hidden: list[int] = ranged([32], Rule(lambda widths: all(h >= 1 for h in widths), "every width must be an integer >= 1"))
    activation: str = ranged("tanh", one_of(ACTIVATIONS))
    task: str = ranged("auto", one_of(TASKS))
    l2: float = ranged(0.0, NON_NEGATIVE)


def build(options: Options, info: dict, retraction=None) -> MLP:
    """An MLP sized from the data's ``info``; ``retraction`` is accepted for a uniform signature (all
    groups are Euclidean)."""
    task = task_of(options, info)
    outputs = info["num_classes"] if task == "classification" else 1
    return MLP(info["num_features"], list(options.hidden), outputs, task, options.activation, options.l2,
               model_dtype(info))
