"""A client of DP-RFedProj: tau private local steps from the broadcast model, then a submission.

One local step (Algorithm 1 of the paper)::

    g = (1/B) sum_l clip_C(P_theta grad f(theta; z_l)) + P_theta xi,   xi ~ N(0, sigma^2 I)
    (u, state) = Opt(g, state);   theta <- Pi(theta - u)

The client releases only its submission ``Agg.Sub(theta_t, theta_local)`` and its optimiser state,
both functions of privatised gradients (post-processing). Its randomness (minibatches and noise)
comes from a ChaCha20 keystream keyed by 256 bits of the operating system's entropy
(:mod:`rfedray.privacy.randomness`), unless the run fixes ``privacy.noise_seed`` for reproducible
experiments; then the key is derived from ``(noise_seed, client_id, round)`` only, so any process
hosting the client reproduces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor
from torch.func import vmap

from rfedray import aggregation
from rfedray.config import OptimizerConfig
from rfedray.geometry import ProductManifold
from rfedray.optim import build_optimizer
from rfedray.privacy.mechanism import (
    ClipShares, noise_generator, nonprivate_gradient, private_gradient_with_noise, rule_gradient, sample_batch,
    standard_noise,
)
from rfedray.privacy.randomness import SecureGenerator
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
    clip_shares : ClipShares or None
        Group-wise clipping, each group to its share of C (the same sensitivity); ``None``: joint.
    """

    local_steps: int
    batch_size: int
    total_rounds: int
    clip: float
    sigma: Optional[float]
    noise_seed: Optional[int] = None
    clip_shares: Optional[ClipShares] = None

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


def round_generator(noise_seed: Optional[int], client_id: int, round_index: int, device: torch.device | str = "cpu") -> SecureGenerator:
    """The generator of one client's round, delivering on ``device``: keyed by OS entropy, or by a key
    derived from the fixed seed and ``(client_id, round_index)``."""
    return noise_generator(noise_seed, device, context=(client_id, round_index))


class Client:
    """One client: its records and how it trains (implements the client side of Algorithm 1).

    The only public way to train is :meth:`local_train`, which releases privatised values only. A
    step's pieces (:meth:`_draw_step`, :meth:`_minibatch`, :meth:`_gradient`, :meth:`_result`)
    return records, batch indices and noise: they are private to this module and to
    :mod:`rfedray.federated.batched`, which trains several clients at once with them.

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

    def _load_optimizer_state(self, optimizer_state: Optional[dict]) -> None:
        """Restore the optimisers' state from a previous participation (``None``: fresh state)."""
        for name, opt in self._optimizers.items():
            opt.load_state_dict((optimizer_state or {}).get(name, {}))

    def _draw_step(self, theta: Params, generator: SecureGenerator) -> tuple[Tensor, Optional[Params]]:
        """The randomness of one local step, drawn from ``generator`` in this order.

        Parameters
        ----------
        theta : dict of Tensor
            Any point of the model: gives the noise its shapes, dtypes and device.
        generator : SecureGenerator
            This client's generator of the round.

        Returns
        -------
        index : Tensor
            The minibatch, ``(B,)`` distinct record indices (:func:`sample_batch`).
        noise : dict of Tensor or None
            Standard Gaussian ambient noise ``{g: (*shape_g)}``, float64 (:func:`standard_noise`); ``None``
            for the non-private baseline.
        """
        index = sample_batch(self.num_records, self.plan.batch_size, generator)
        noise = standard_noise(self.product, theta, generator) if self.plan.private else None
        return index, noise

    def _minibatch(self, index: Tensor) -> tuple[Tensor, ...]:
        """The records at ``index`` (shape ``(B,)``): each tensor of shape ``(B, ...)``."""
        return tuple(t.index_select(0, index) for t in self._data.train)

    def _gradient(self, params: Params, batch: tuple[Tensor, ...], noise: Optional[Params]) -> Params:
        """The step's tangent gradient at ``params``: privatised with ``noise``, or the plain mean.

        Draws no random numbers (they come from :meth:`_draw_step`), so it can be vmapped over
        clients.
        """
        if self.plan.private:
            return private_gradient_with_noise(
                self.model.per_sample_loss, params, self.product, batch,
                clip=self.plan.clip, sigma=self.plan.sigma, noise=noise, rule=self.model.gradient_rule,
                shares=self.plan.clip_shares,
            )
        return nonprivate_gradient(self.model.per_sample_loss, params, self.product, batch)

    def _gradients_of_clients(self, params: Params, batch: tuple[Tensor, ...], noise: Optional[Params]) -> Params:
        """:meth:`_gradient` of K clients sharing this client's model and plan, in one call: every
        input has a leading client dimension. With the model's closed-form per-record gradients
        the operations broadcast over it (:func:`rule_gradient`); otherwise ``vmap`` over clients."""
        rule = self.model.gradient_rule
        if self.plan.private and rule is not None:
            return rule_gradient(rule, params, self.product, batch, clip=self.plan.clip, sigma=self.plan.sigma,
                                 noise=noise, batch_size=self.plan.batch_size, shares=self.plan.clip_shares)
        return vmap(self._gradient, in_dims=(0, 0, 0 if self.plan.private else None))(params, batch, noise)

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
        self._load_optimizer_state(optimizer_state)
        device = next(iter(theta.values())).device
        generator = round_generator(self.plan.noise_seed, self.client_id, round_index, device)
        params = {name: value.clone() for name, value in theta.items()}
        for j in range(self.plan.local_steps):
            index, noise = self._draw_step(params, generator)
            grad = self._gradient(params, self._minibatch(index), noise)
            step = round_index * self.plan.local_steps + j
            params = {name: self._optimizers[name].step(params[name], grad[name], step) for name in params}
        return self._result(theta, params, start)

    def _result(self, theta: Params, params: Params, start: float) -> LocalResult:
        """The submission for the local iterate ``params`` and the optimisers' current state.

        Parameters
        ----------
        theta : dict of Tensor
            theta_t.
        params : dict of Tensor
            The local iterate after tau steps.
        start : float
            ``time.perf_counter()`` when the training began.
        """
        submission = aggregation.submit(self.scheme, self.product, theta, params)
        state = {name: opt.state_dict() for name, opt in self._optimizers.items()}
        return LocalResult(submission, state, time.perf_counter() - start)
