"""Local optimisers for one parameter group, applied to privatised tangent gradients.

A client's private step produces ``g`` (clipped per-sample tangent gradients averaged, plus
projected Gaussian noise). Whatever an optimiser does with ``g`` is post-processing, so any of
them keeps the privacy guarantee. One step is

    ``(u, state) = update(x, g, state, lr_t)``,  ``x <- Pi(x - u)``,

with ``lr_t = lr * schedule(step_index)`` and ``Pi`` the group's nearest-point projection (the
projection retraction). On a Euclidean group every optimiser is the usual one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch
from torch import Tensor

from rfedray.geometry import Manifold

if TYPE_CHECKING:
    from rfedray.config import OptimizerConfig

State = dict[str, Tensor]


def _integer(name: str, value: int, low: int) -> int:
    """``value`` as an int, checked to be an integer >= ``low``."""
    if int(value) != value or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
    return int(value)


def _check_unit_interval(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise ValueError(f"{name}={value!r}: must be in [0, 1)")


class LRSchedule(ABC):
    """A learning-rate multiplier as a function of the local step index."""

    hyperparameters: ClassVar[tuple[str, ...]] = ()
    """Its constructor's arguments, read by name from the optimiser's configuration section
    (``total_steps``: the local steps the schedule spans; :func:`build_optimizer`)."""

    @abstractmethod
    def __call__(self, step_index: int) -> float:
        """The multiplier of the base learning rate at ``step_index`` (>= 0)."""


class Constant(LRSchedule):
    """Multiplier 1 at every step."""

    def __call__(self, step_index: int) -> float:
        _integer("step_index", step_index, 0)
        return 1.0


class StepDecay(LRSchedule):
    """Multiplier ``gamma ** (step_index // step_size)``.

    Parameters
    ----------
    step_size : int
        Steps between two decays, >= 1.
    gamma : float
        Decay factor, in (0, 1].
    """

    hyperparameters = ("step_size", "gamma")

    def __init__(self, step_size: int, gamma: float):
        self.step_size = _integer("step_size", step_size, 1)
        if not (0.0 < gamma <= 1.0):
            raise ValueError(f"gamma={gamma!r}: must be in (0, 1]")
        self.gamma = float(gamma)

    def __call__(self, step_index: int) -> float:
        _integer("step_index", step_index, 0)
        return self.gamma ** (int(step_index) // self.step_size)


class Cosine(LRSchedule):
    """Multiplier ``(1 + cos(pi min(step_index, total_steps) / total_steps)) / 2``: 1 at the start,
    0 from ``total_steps`` on.

    Parameters
    ----------
    total_steps : int
        Length of the decay, >= 1.
    """

    hyperparameters = ("total_steps",)

    def __init__(self, total_steps: int):
        self.total_steps = _integer("total_steps", total_steps, 1)

    def __call__(self, step_index: int) -> float:
        _integer("step_index", step_index, 0)
        return 0.5 * (1.0 + math.cos(math.pi * min(int(step_index), self.total_steps) / self.total_steps))


class LocalOptimizer(ABC):
    """A first-order optimiser on one manifold factor, stepping by ``x <- Pi(x - u)``.

    Parameters
    ----------
    manifold : Manifold
        The parameter group's manifold.
    lr : float
        Base learning rate, > 0.
    schedule : LRSchedule, optional
        Learning-rate multiplier; :class:`Constant` by default.
    weight_decay : float
        ``g <- g + weight_decay * P_x(x)`` before the update, >= 0. On a Euclidean group this is
        the usual L2 term; on the sphere, Stiefel and Grassmann manifolds ``P_x(x) = 0`` (points
        have constant norm), so it has no effect there.
    """

    hyperparameters: ClassVar[tuple[str, ...]] = ()
    """Its constructor's arguments besides the manifold, ``lr``, the schedule and ``weight_decay``,
    read by name from its configuration section (:func:`build_optimizer`)."""

    def __init__(self, manifold: Manifold, lr: float, schedule: LRSchedule | None = None, weight_decay: float = 0.0):
        if not isinstance(manifold, Manifold):
            raise ValueError(f"manifold={manifold!r}: must be an rfedray.geometry.Manifold")
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr={lr!r}: must be a finite number > 0")
        if schedule is not None and not isinstance(schedule, LRSchedule):
            raise ValueError(f"schedule={schedule!r}: must be an LRSchedule (Constant, StepDecay or Cosine)")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay={weight_decay!r}: must be a finite number >= 0")
        self.manifold = manifold
        self.lr = float(lr)
        self.schedule = schedule if schedule is not None else Constant()
        self.weight_decay = float(weight_decay)
        self.state: State = {}

    @abstractmethod
    def update(self, x: Tensor, g: Tensor, state: State, lr: float) -> tuple[Tensor, State]:
        """The step ``u`` and the new state from the point, the gradient and the old state.

        Parameters
        ----------
        x : Tensor
            Current point, shape ``(*shape)``.
        g : Tensor
            Privatised tangent gradient at ``x``, shape ``(*shape)``.
        state : dict of Tensor
            The optimiser's state (empty before the first step); not modified.
        lr : float
            Learning rate of this step.

        Returns
        -------
        u : Tensor
            Shape ``(*shape)``; the step is ``x <- Pi(x - u)``.
        state : dict of Tensor
        """

    def step(self, x: Tensor, g: Tensor, step_index: int) -> Tensor:
        """One local step: the new point ``Pi(x - u)``.

        Parameters
        ----------
        x : Tensor
            Current point, shape ``(*shape)``.
        g : Tensor
            Privatised tangent gradient at ``x``, shape ``(*shape)``.
        step_index : int
            Index of the step in the client's local schedule, >= 0.
        """
        lr = self.lr * self.schedule(step_index)
        if self.weight_decay:
            g = g + self.weight_decay * self.manifold.proj_tangent(x, x)
        u, self.state = self.update(x, g, self.state, lr)
        return self.manifold.project_step(x, -u)

    def state_dict(self) -> dict[str, Any]:
        """A copy of the optimiser state: ``{"optimizer": class name, "state": {name: Tensor}}``."""
        return {"optimizer": type(self).__name__, "state": {k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` of the same kind of optimiser.

        An empty mapping resets the optimiser to its initial (empty) state.
        """
        if not state_dict:
            self.state = {}
            return
        if state_dict.get("optimizer") != type(self).__name__:
            raise ValueError(
                f"state_dict['optimizer']={state_dict.get('optimizer')!r}: this optimiser is {type(self).__name__}"
            )
        self.state = {k: torch.as_tensor(v).clone() for k, v in state_dict["state"].items()}


class RSGD(LocalOptimizer):
    """Riemannian SGD with the projection retraction: ``u = lr g``, ``x <- Pi(x - lr g)``."""

    def update(self, x: Tensor, g: Tensor, state: State, lr: float) -> tuple[Tensor, State]:
        return lr * g, state


class SGDMomentum(LocalOptimizer):
    """Heavy-ball momentum: ``b <- momentum P_x(b) + g``, ``u = lr b``.

    The buffer ``b`` is kept in the ambient space. It was built from gradients at earlier points,
    so before it is used at ``x`` it is projected onto ``T_x M`` (vector transport by projection,
    Absil, Mahony and Sepulchre 2008, section 8.1.3); ``u`` is then tangent at ``x``. With
    ``momentum = 0`` this is :class:`RSGD`.

    Parameters
    ----------
    momentum : float
        In [0, 1).
    """

    hyperparameters = ("momentum",)

    def __init__(
        self,
        manifold: Manifold,
        lr: float,
        schedule: LRSchedule | None = None,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ):
        super().__init__(manifold, lr, schedule, weight_decay)
        _check_unit_interval("momentum", momentum)
        self.momentum = float(momentum)

    def update(self, x: Tensor, g: Tensor, state: State, lr: float) -> tuple[Tensor, State]:
        buf = state.get("momentum_buffer")
        buf = g if buf is None else self.momentum * self.manifold.proj_tangent(x, buf) + g
        return lr * buf, {"momentum_buffer": buf}


class Adam(LocalOptimizer):
    """Adam with its moments in the ambient space and the step projected onto ``T_x M``.

    ``m <- beta1 m + (1 - beta1) g``, ``v <- beta2 v + (1 - beta2) g * g`` (elementwise, ambient
    coordinates, no transport between points), bias correction as in Kingma and Ba, then
    ``u = lr P_x(m_hat / (sqrt(v_hat) + eps))``. The elementwise preconditioning does not preserve
    tangency, so ``u`` is projected onto ``T_x`` before the retraction ``Pi(x - u)``: the step then
    moves along the manifold to first order, as RSGD's does. On a Euclidean group this is exactly
    ``torch.optim.Adam`` (with L2 weight decay).

    Parameters
    ----------
    beta1, beta2 : float
        In [0, 1).
    eps : float
        > 0.
    """

    hyperparameters = ("beta1", "beta2", "eps")

    def __init__(
        self,
        manifold: Manifold,
        lr: float,
        schedule: LRSchedule | None = None,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(manifold, lr, schedule, weight_decay)
        _check_unit_interval("beta1", beta1)
        _check_unit_interval("beta2", beta2)
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps={eps!r}: must be a finite number > 0")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    def update(self, x: Tensor, g: Tensor, state: State, lr: float) -> tuple[Tensor, State]:
        zero = torch.zeros_like(g)
        m = self.beta1 * state.get("exp_avg", zero) + (1 - self.beta1) * g
        v = self.beta2 * state.get("exp_avg_sq", zero) + (1 - self.beta2) * g * g
        t = state.get("step", torch.zeros((), dtype=torch.int64)) + 1
        m_hat = m / (1 - self.beta1 ** int(t))
        v_hat = v / (1 - self.beta2 ** int(t))
        u = lr * self.manifold.proj_tangent(x, m_hat / (v_hat.sqrt() + self.eps))
        return u, {"exp_avg": m, "exp_avg_sq": v, "step": t}


OPTIMIZERS: dict[str, type[LocalOptimizer]] = {"rsgd": RSGD, "sgd": SGDMomentum, "adam": Adam}
SCHEDULES: dict[str, type[LRSchedule]] = {"constant": Constant, "step": StepDecay, "cosine": Cosine}


def build_optimizer(cfg: OptimizerConfig, manifold: Manifold, total_steps: int) -> LocalOptimizer:
    """The optimiser and schedule named by ``cfg`` for one parameter group.

    Parameters
    ----------
    cfg : OptimizerConfig
        ``name`` in ``OPTIMIZERS``, ``schedule`` in ``SCHEDULES``, and their hyperparameters.
    manifold : Manifold
        The group's manifold.
    total_steps : int
        Number of local steps the schedule spans (``Cosine`` decays to 0 over it), >= 1.
    """
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"name={cfg.name!r}: must be one of {', '.join(OPTIMIZERS)}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule={cfg.schedule!r}: must be one of {', '.join(SCHEDULES)}")
    total_steps = _integer("total_steps", total_steps, 1)

    def options(kind: type) -> dict[str, Any]:
        """``kind``'s hyperparameters from ``cfg`` (the schedule's ``total_steps``: the argument)."""
        return {k: total_steps if k == "total_steps" else getattr(cfg, k) for k in kind.hyperparameters}

    schedule_class, optimizer_class = SCHEDULES[cfg.schedule], OPTIMIZERS[cfg.name]
    schedule = schedule_class(**options(schedule_class))
    return optimizer_class(manifold, cfg.lr, schedule, weight_decay=cfg.weight_decay, **options(optimizer_class))
