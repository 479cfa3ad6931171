"""A client of DP-RFedProj: tau private local steps from the broadcast model, then a submission.

One local step (Algorithm 1 of the paper)::

    g = (1/B) sum_l clip_C(P_theta grad f(theta; z_l)) + P_theta xi,   xi ~ N(0, sigma^2 I)
    (u, state) = Opt(g, state);   theta <- Pi(theta - u)

The client releases only its submission ``Agg.Sub(theta_t, theta_local)`` and its optimiser state,
both functions of privatised gradients (post-processing). Its randomness (minibatches and noise)
comes from a generator drawn from the operating system's entropy, unless the run fixes
``privacy.noise_seed`` for reproducible experiments; then it is a function of
``(noise_seed, client_id, round)`` only, so any process hosting the client reproduces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np
import torch

from rfedray import aggregation
from rfedray.config import OptimizerConfig
from rfedray.geometry import ProductManifold
from rfedray.optim import build_optimizer
from rfedray.privacy.mechanism import noise_generator, nonprivate_gradient, private_gradient, sample_batch
from rfedray.task import ClientData, FederatedModel, Params


@dataclass(frozen=True)
class LocalPlan:
    """What every client does in a round (identical across clients, public).

    Attributes
    ----------
    local_steps, batch_size : int
        tau and B.
    total_rounds : int
        T, for learning-rate schedules (the step index is ``round * tau + j``).
    clip : float
        C.
    sigma : float or None
        Absolute noise standard deviation; ``None`` for the non-private baseline.
    noise_seed : int or None
        ``None``: OS entropy. An integer makes the run reproducible and not for production.
    """

    local_steps: int
    batch_size: int
    total_rounds: int
    clip: float
    sigma: Optional[float]
    noise_seed: Optional[int] = None

    @property
    def private(self) -> bool:
        return self.sigma is not None


@dataclass
class LocalResult:
    """What leaves a client after a round: its submission and optimiser state (both privatised)."""

    submission: Params
    optimizer_state: dict[str, Any]
    train_seconds: float


@dataclass
class ClientFailure:
    """A client that did not answer in a round (crash, lost node, deadline)."""

    reason: str


def round_generator(noise_seed: Optional[int], client_id: int, round_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one client's round, on ``device``: OS entropy, or derived from the fixed seed."""
    if noise_seed is None:
        return noise_generator(None, device)
    derived = np.random.SeedSequence(entropy=noise_seed, spawn_key=(client_id, round_index)).generate_state(2)
    return noise_generator(int(derived[0]) << 32 | int(derived[1]), device)


class Client:
    """One client: its records and how it trains (implements the client side of Algorithm 1).

    Parameters
    ----------
    client_id : int
    data : ClientData
        Its records; they never leave this object.
    model : FederatedModel
    scheme : rfedray.aggregation.AggregationScheme
    optim : mapping from group name (or ``"default"``) to OptimizerConfig
    plan : LocalPlan
    """

    def __init__(
        self,
        client_id: int,
        data: ClientData,
        model: FederatedModel,
        scheme: aggregation.AggregationScheme,
        optim: Mapping[str, OptimizerConfig],
        plan: LocalPlan,
    ):
        self.client_id = client_id
        self._data = data
        self.model = model
        self.product = ProductManifold(model.groups)
        self.scheme = scheme
        self.plan = plan
        total_steps = plan.total_rounds * plan.local_steps
        self._optimizers = {
            name: build_optimizer(optim.get(name, optim["default"]), manifold, total_steps)
            for name, manifold in model.groups.items()
        }

    @property
    def num_records(self) -> int:
        return self._data.num_records

    def _gradient(self, params: Params, batch: tuple[torch.Tensor, ...], generator: torch.Generator) -> Params:
        if self.plan.private:
            return private_gradient(
                self.model.per_sample_loss, params, self.product, batch,
                clip=self.plan.clip, sigma=self.plan.sigma, generator=generator,
            )
        return nonprivate_gradient(self.model.per_sample_loss, params, self.product, batch)

    def local_train(self, theta: Params, round_index: int, optimizer_state: Optional[dict] = None) -> LocalResult:
        """Run tau local steps from ``theta`` and return the scheme's submission.

        Parameters
        ----------
        theta : dict of Tensor
            The broadcast model theta_t (not modified).
        round_index : int
            t, used for the learning-rate schedule and the seeded generator.
        optimizer_state : dict or None
            The state this client's optimisers ended the previous participation with.
        """
        start = time.perf_counter()
        for name, opt in self._optimizers.items():
            opt.load_state_dict((optimizer_state or {}).get(name, {}))
        device = next(iter(theta.values())).device
        generator = round_generator(self.plan.noise_seed, self.client_id, round_index, device)
        params = {name: value.clone() for name, value in theta.items()}
        m = self.num_records
        for j in range(self.plan.local_steps):
            index = sample_batch(m, self.plan.batch_size, generator)
            batch = tuple(t[index] for t in self._data.train)
            grad = self._gradient(params, batch, generator)
            step = round_index * self.plan.local_steps + j
            params = {name: self._optimizers[name].step(params[name], grad[name], step) for name in params}
        submission = aggregation.submit(self.scheme, self.product, theta, params)
        state = {name: opt.state_dict() for name, opt in self._optimizers.items()}
        return LocalResult(submission, state, time.perf_counter() - start)
