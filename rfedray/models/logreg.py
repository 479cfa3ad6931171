"""Generalised linear models on a Euclidean parameter space: logistic and linear regression.

Both implement :class:`rfedray.task.FederatedModel` with two Euclidean groups, ``weight`` of shape
``(K, d)`` and ``bias`` of shape ``(K,)`` (``K`` classes, or 1 output for regression). The per-record
loss carries the ridge term ``l2/2 (||W||^2 + ||b||^2)``, so the empirical risk is strongly convex
and its M-estimator (the pooled minimiser) is unique: the target of the M-estimation study.

The loss and metric helpers here are shared by :mod:`rfedray.models.mlp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rfedray.options import DTYPES, NON_NEGATIVE, Checked, OptionsError, one_of, ranged
from rfedray.geometry import Euclidean
from rfedray.task import EvalData, Params

TASKS = ("auto", "classification", "regression")


def cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    """Softmax cross-entropy of logits ``(..., K)`` against integer labels ``(...)``; vmap-safe."""
    picked = logits.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
    return torch.logsumexp(logits, dim=-1) - picked


def squared_error(pred: Tensor, y: Tensor) -> Tensor:
    """Half squared error ``(pred - y)^2 / 2`` of predictions ``(..., 1)`` against targets ``(...)``."""
    return 0.5 * (pred.squeeze(-1) - y) ** 2


def ridge(params: Params, l2: float) -> Tensor:
    """``l2/2`` times the squared norm of every parameter."""
    return 0.5 * l2 * sum((v ** 2).sum() for v in params.values())


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Accuracy and mean cross-entropy."""
    return {
        "accuracy": float((logits.argmax(-1) == y).double().mean()),
        "loss": float(cross_entropy(logits, y).mean()),
    }


def regression_metrics(pred: Tensor, y: Tensor) -> dict[str, float]:
    """Mean squared error (``loss``) and the coefficient of determination ``r2``."""
    pred = pred.squeeze(-1).double()
    y = y.double()
    mse = float(((pred - y) ** 2).mean())
    var = float(((y - y.mean()) ** 2).mean())
    return {"loss": mse, "r2": 1.0 - mse / var if var > 0 else float("nan")}


def parameter_error(params: Params, optimum: dict) -> float:
    """Euclidean distance ``||theta - theta*||`` over every group present in ``optimum``."""
    total = 0.0
    for name, value in optimum.items():
        ref = torch.as_tensor(value, dtype=torch.float64).reshape(params[name].shape)
        total += float(((params[name].double() - ref) ** 2).sum())
    return total ** 0.5


class GLMHessian:
    """Closed-form per-record Hessians of a GLM with ridge, for Newton-type strategies.

    A record's Hessian is ``A (x) u u^T + l2 I`` with ``u = (x, 1)`` and ``A`` the ``K x K`` curvature of
    the link (``diag(p) - p p^T`` for softmax, ``1`` for the squared loss), so its Frobenius norm and
    any weighted sum over records need no ``P x P`` matrix per record. Both methods follow the
    parameter order ``weight`` (row-major) then ``bias`` of :class:`rfedray.mestimation.local.ParamLayout`.
    """

    l2: float

    gradient_rule = None
    """Per-record gradients by ``vmap(grad)`` (no closed form: see :class:`~rfedray.privacy.mechanism.PerSampleRule`)."""

    def curvature(self, params: Params, x: Tensor) -> Tensor:
        """``A`` of every record, shape ``(B, K, K)``."""
        raise NotImplementedError

    @staticmethod
    def _augment(x: Tensor) -> Tensor:
        return torch.cat([x, torch.ones(x.shape[:-1] + (1,), dtype=x.dtype)], dim=-1)

    def per_sample_hessian_norms(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """Frobenius norm of every record's Hessian, shape ``(B,)``."""
        a = self.curvature(params, x)
        u2 = (self._augment(x) ** 2).sum(-1)
        size = sum(v.numel() for v in params.values())
        trace = torch.diagonal(a, dim1=-2, dim2=-1).sum(-1)
        sq = (a ** 2).sum((-2, -1)) * u2 ** 2 + 2 * self.l2 * trace * u2 + self.l2 ** 2 * size
        return sq.clamp_min(0).sqrt()

    def weighted_hessian_sum(self, params: Params, weights: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``sum_l w_l H_l``, shape ``(P, P)`` in the (weight, bias) order."""
        a = self.curvature(params, x)
        u = self._augment(x)
        k, d = a.shape[-1], x.shape[-1]
        full = torch.einsum("b,bij,bk,bl->ikjl", weights, a, u, u)
        ww = full[:, :d, :, :d].reshape(k * d, k * d)
        wb = full[:, :d, :, d].reshape(k * d, k)
        bb = full[:, d, :, d]
        top = torch.cat([ww, wb], dim=1)
        bottom = torch.cat([wb.mT, bb], dim=1)
        hess = torch.cat([top, bottom], dim=0)
        return hess + self.l2 * weights.sum() * torch.eye(hess.shape[0], dtype=hess.dtype)


class LogisticRegression(GLMHessian):
    """Multinomial logistic regression ``softmax(W x + b)`` with a ridge term in every record's loss.

    With two classes the model has one logit (``W`` of shape ``(1, d)``, the class-0 logit fixed at
    0): the identifiable binary logistic regression, whose Hessian has no flat direction.

    Parameters
    ----------
    num_features, num_classes : int
    l2 : float
        Ridge coefficient, >= 0.
    dtype : torch.dtype
    """

    def __init__(self, num_features: int, num_classes: int, l2: float = 1e-3, dtype: torch.dtype = torch.float64):
        if num_features < 1 or num_classes < 2:
            raise ValueError(f"num_features={num_features}, num_classes={num_classes}: need >= 1 and >= 2")
        if l2 < 0:
            raise ValueError(f"l2={l2}: must be >= 0")
        self.num_features, self.num_classes, self.l2, self.dtype = num_features, num_classes, l2, dtype
        outputs = 1 if num_classes == 2 else num_classes
        self.groups = {"weight": Euclidean(outputs, num_features), "bias": Euclidean(outputs)}

    def init_params(self, generator: torch.Generator) -> Params:
        """The origin (the loss is convex, so the start only matters for the path)."""
        return {name: torch.zeros(m.shape, dtype=self.dtype) for name, m in self.groups.items()}

    def logits(self, params: Params, x: Tensor) -> Tensor:
        """Class logits, shape ``(..., num_classes)``."""
        z = x @ params["weight"].mT + params["bias"]
        return torch.cat([torch.zeros_like(z), z], dim=-1) if self.num_classes == 2 else z

    def curvature(self, params: Params, x: Tensor) -> Tensor:
        if self.num_classes == 2:
            p = torch.sigmoid(x @ params["weight"].mT + params["bias"])
            return (p * (1 - p))[..., None]
        p = torch.softmax(self.logits(params, x), dim=-1)
        return torch.diag_embed(p) - p[..., :, None] * p[..., None, :]

    def per_sample_loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        return cross_entropy(self.logits(params, x), y) + ridge(params, self.l2)

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        x, y = data.tensors
        with torch.no_grad():
            return classification_metrics(self.logits(params, x.to(self.dtype)), y)


class LinearRegression(GLMHessian):
    """Linear regression ``w^T x + b`` with the half squared loss and a ridge term.

    Parameters
    ----------
    num_features : int
    l2 : float
        Ridge coefficient, >= 0.
    dtype : torch.dtype
    """

    def __init__(self, num_features: int, l2: float = 0.0, dtype: torch.dtype = torch.float64):
        if num_features < 1:
            raise ValueError(f"num_features={num_features}: must be >= 1")
        if l2 < 0:
            raise ValueError(f"l2={l2}: must be >= 0")
        self.num_features, self.l2, self.dtype = num_features, l2, dtype
        self.groups = {"weight": Euclidean(1, num_features), "bias": Euclidean(1)}

    def init_params(self, generator: torch.Generator) -> Params:
        return {name: torch.zeros(m.shape, dtype=self.dtype) for name, m in self.groups.items()}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        return x @ params["weight"].mT + params["bias"]

    def curvature(self, params: Params, x: Tensor) -> Tensor:
        return torch.ones(x.shape[:-1] + (1, 1), dtype=x.dtype)

    def per_sample_loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        return squared_error(self.predict(params, x), y) + ridge(params, self.l2)

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        x, y = data.tensors
        with torch.no_grad():
            metrics = regression_metrics(self.predict(params, x.to(self.dtype)), y)
        if "optimum" in data.extra:
            metrics["param_error"] = parameter_error(params, data.extra["optimum"])
        return metrics


@dataclass
class Options(Checked):
    """Schema of ``model.options`` for ``model.name: logreg``.

    Attributes
    ----------
    task : {"auto", "classification", "regression"}
        ``auto`` follows the data (logistic for classification, linear for regression).
    l2 : float
        Ridge coefficient.
    """

    task: str = ranged("auto", one_of(TASKS))
    l2: float = ranged(1e-3, NON_NEGATIVE)


def model_dtype(info: dict) -> torch.dtype:
    return DTYPES[info.get("dtype", "float64")]


def task_of(options, info: dict) -> str:
    """The task of a model of ``options`` (validated) on data described by ``info``: the data's."""
    options.validate("model.options")
    task = info["task"] if options.task == "auto" else options.task
    OptionsError.check(task == info["task"], "model.options.task", options.task, f"the data is a {info['task']} task")
    return task


def build(options: Options, info: dict, retraction=None):
    """Logistic or linear regression sized from the data's ``info``; ``retraction`` is accepted for a
    uniform signature (all groups are Euclidean)."""
    if task_of(options, info) == "classification":
        return LogisticRegression(info["num_features"], info["num_classes"], options.l2, model_dtype(info))
    return LinearRegression(info["num_features"], options.l2, model_dtype(info))
