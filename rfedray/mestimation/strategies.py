"""Private federated M-estimation strategies (Auddy, Peng and Paul): FedSGD, FedAvg, FedHybrid,
FedNewton.

A strategy says, for round ``t``, which task every selected client runs (:meth:`Strategy.task`),
how many private steps that task releases (:meth:`Strategy.steps`, what the ledger is charged
before the round), and how the server combines the released results (:meth:`Strategy.aggregate`).

- :class:`FedSGD`: one private gradient per client; the server averages and steps
  ``theta <- theta - lr * mean(g_i)``. Unbiased, one communication round per step.
- :class:`FedAvg`: ``tau`` private local SGD steps per client; the server averages the local
  models. Few rounds, but with heterogeneous clients the fixed point is biased ("federation
  bias").
- :class:`FedHybrid`: FedAvg for the first ``switch_round`` rounds (a good initial estimate), then
  FedSGD from there.
- :class:`FedNewton`: every client takes private local Newton steps (privatised gradient and
  Hessian, see :mod:`rfedray.mestimation.local`) from the broadcast model; the server averages the
  local Newton iterates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from rfedray.federated.client import round_generator
from rfedray.federated.engine import HostedClient
from rfedray.mestimation.local import PAIR_FACTOR, ParamLayout, StepPlan, newton_direction, private_hessian, step_gradient
from rfedray.privacy import checks
from rfedray.task import Params


def mean_params(items: Sequence[Params]) -> Params:
    """Coordinate-wise mean of parameter dicts."""
    return {name: torch.stack([p[name] for p in items]).mean(0) for name in items[0]}


@dataclass(frozen=True)
class GradientTask:
    """FedSGD client: one private gradient at the broadcast model."""

    plan: StepPlan

    def __call__(self, client: HostedClient, theta: Params, round_index: int) -> Params:
        gen = round_generator(self.plan.noise_seed, client.client_id, round_index)
        batch = self.plan.batch(client.data.train, gen)
        return step_gradient(client.model.per_sample_loss, theta, batch, self.plan.clip, self.plan.sigma(self.plan.clip), gen)


@dataclass(frozen=True)
class LocalSGDTask:
    """FedAvg client: ``local_steps`` private SGD steps of size ``lr`` from the broadcast model."""

    plan: StepPlan
    local_steps: int
    lr: float

    def __call__(self, client: HostedClient, theta: Params, round_index: int) -> Params:
        gen = round_generator(self.plan.noise_seed, client.client_id, round_index)
        params = {k: v.clone() for k, v in theta.items()}
        for _ in range(self.local_steps):
            batch = self.plan.batch(client.data.train, gen)
            grad = step_gradient(client.model.per_sample_loss, params, batch, self.plan.clip,
                                 self.plan.sigma(self.plan.clip), gen)
            params = {k: params[k] - self.lr * grad[k] for k in params}
        return params


@dataclass(frozen=True)
class LocalNewtonTask:
    """FedNewton client: ``newton_steps`` private (damped) Newton steps from the broadcast model.

    Attributes
    ----------
    plan : StepPlan
    newton_steps : int
    hessian_clip : float
        Frobenius clip ``C_H`` of every per-record Hessian.
    damping : float
        Step size of the Newton update (1 = full step).
    floor : float
        Smallest eigenvalue kept in the privatised Hessian.
    chunk_size : int
        Records per vmapped Hessian chunk.
    """

    plan: StepPlan
    newton_steps: int
    hessian_clip: float
    damping: float
    floor: float
    chunk_size: int = 32

    def __call__(self, client: HostedClient, theta: Params, round_index: int) -> Params:
        gen = round_generator(self.plan.noise_seed, client.client_id, round_index)
        loss = client.model.per_sample_loss
        layout = ParamLayout.of(theta)
        params = {k: v.clone() for k, v in theta.items()}
        for _ in range(self.newton_steps):
            batch = self.plan.batch(client.data.train, gen)
            grad = step_gradient(loss, params, batch, self.plan.clip, self.plan.sigma(self.plan.clip, PAIR_FACTOR), gen)
            hess = private_hessian(client.model, params, batch, self.hessian_clip,
                                   self.plan.sigma(self.hessian_clip, PAIR_FACTOR), gen, self.chunk_size)
            step = newton_direction(hess, layout.flatten(grad), self.floor)
            params = layout.unflatten(layout.flatten(params) - self.damping * step)
        return params


class Strategy(ABC):
    """A server strategy: per-round client task, private-step count and aggregation."""

    name: str

    @abstractmethod
    def task(self, plan: StepPlan, round_index: int):
        """The picklable client task of round ``round_index``."""

    @abstractmethod
    def steps(self, round_index: int) -> int:
        """Private steps (identical Gaussian mechanisms) each participant releases in that round."""

    @abstractmethod
    def aggregate(self, theta: Params, results: Sequence[Params], round_index: int) -> Params:
        """The next global model from the released results of the round."""

    def total_steps(self, rounds: int) -> int:
        return sum(self.steps(t) for t in range(rounds))

    def describe(self) -> dict:
        return {"strategy": self.name}


class FedSGD(Strategy):
    """One private gradient per client and round; the server steps with ``lr``.

    Parameters
    ----------
    lr : float
        Server step size, > 0.
    """

    name = "fedsgd"

    def __init__(self, lr: float = 1.0):
        checks.positive("lr", lr)
        self.lr = lr

    def task(self, plan, round_index):
        return GradientTask(plan)

    def steps(self, round_index):
        return 1

    def aggregate(self, theta, results, round_index):
        g = mean_params(results)
        return {k: theta[k] - self.lr * g[k] for k in theta}

    def describe(self):
        return {"strategy": self.name, "lr": self.lr}


class FedAvg(Strategy):
    """``local_steps`` private local SGD steps; the server averages the local models.

    Parameters
    ----------
    local_steps : int
        tau >= 1.
    lr : float
        Local step size, > 0.
    """

    name = "fedavg"

    def __init__(self, local_steps: int = 10, lr: float = 1.0):
        checks.positive_int("local_steps", local_steps)
        checks.positive("lr", lr)
        self.local_steps, self.lr = local_steps, lr

    def task(self, plan, round_index):
        return LocalSGDTask(plan, self.local_steps, self.lr)

    def steps(self, round_index):
        return self.local_steps

    def aggregate(self, theta, results, round_index):
        return mean_params(results)

    def describe(self):
        return {"strategy": self.name, "local_steps": self.local_steps, "lr": self.lr}


class FedHybrid(Strategy):
    """FedAvg for ``switch_round`` rounds, then FedSGD.

    Parameters
    ----------
    fedavg : FedAvg
    fedsgd : FedSGD
    switch_round : int
        Rounds of FedAvg, >= 1.
    """

    name = "fedhybrid"

    def __init__(self, fedavg: FedAvg, fedsgd: FedSGD, switch_round: int):
        checks.positive_int("switch_round", switch_round)
        self.fedavg, self.fedsgd, self.switch_round = fedavg, fedsgd, switch_round

    def _phase(self, round_index: int) -> Strategy:
        return self.fedavg if round_index < self.switch_round else self.fedsgd

    def task(self, plan, round_index):
        return self._phase(round_index).task(plan, round_index)

    def steps(self, round_index):
        return self._phase(round_index).steps(round_index)

    def aggregate(self, theta, results, round_index):
        return self._phase(round_index).aggregate(theta, results, round_index)

    def describe(self):
        return {"strategy": self.name, "switch_round": self.switch_round,
                "fedavg": self.fedavg.describe(), "fedsgd": self.fedsgd.describe()}


class FedNewton(Strategy):
    """Private local Newton steps on every client; the server averages the local iterates.

    Parameters
    ----------
    newton_steps : int
        Local Newton steps per round, >= 1.
    hessian_clip : float
        Frobenius clip of the per-record Hessians, > 0.
    damping : float
        Newton step size in (0, 1].
    floor : float
        Eigenvalue floor of the privatised Hessian, > 0.
    chunk_size : int
        Records per vmapped Hessian chunk.
    max_params : int
        Refuse models with more parameters (the Hessian is ``P x P`` per record chunk).
    """

    name = "fednewton"

    def __init__(self, newton_steps: int = 1, hessian_clip: float = 1.0, damping: float = 1.0, floor: float = 1e-2,
                 chunk_size: int = 32, max_params: int = 4096):
        checks.positive_int("newton_steps", newton_steps)
        checks.positive("hessian_clip", hessian_clip)
        if not 0 < damping <= 1:
            raise ValueError(f"damping={damping}: must be in (0, 1]")
        checks.positive("floor", floor)
        checks.positive_int("chunk_size", chunk_size)
        self.newton_steps, self.hessian_clip, self.damping, self.floor = newton_steps, hessian_clip, damping, floor
        self.chunk_size, self.max_params = chunk_size, max_params

    def check_model(self, theta: Params) -> None:
        size = ParamLayout.of(theta).size
        if size > self.max_params:
            raise ValueError(f"model has {size} parameters: FedNewton forms P x P Hessians and allows at most "
                             f"max_params={self.max_params}; use a smaller model or raise max_params")

    def task(self, plan, round_index):
        return LocalNewtonTask(plan, self.newton_steps, self.hessian_clip, self.damping, self.floor, self.chunk_size)

    def steps(self, round_index):
        return self.newton_steps

    def aggregate(self, theta, results, round_index):
        return mean_params(results)

    def describe(self):
        return {"strategy": self.name, "newton_steps": self.newton_steps, "hessian_clip": self.hessian_clip,
                "damping": self.damping, "floor": self.floor}
