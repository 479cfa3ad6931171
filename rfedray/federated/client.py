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

One kernel trains: :func:`train_together` runs the tau steps of K clients that share the model, the
plan and the structure of their optimiser states at once (the gradient over a leading client
dimension of the parameters, minibatches and noise: broadcasting through the model's closed-form
per-record gradients where it has them, else ``torch.func.vmap`` over clients; the optimisers step
the stacked parameters and states, since manifold operations broadcast over leading dimensions and
the learning rate is the same for every client of the round). :meth:`Client.local_train` is its
one-client case. The randomness is each client's own: every client draws its minibatch indices and
its noise from its own generator (:func:`round_generator`) in the same order whatever the other
clients of the call, and every kernel computes each client's slice as it would for that client
alone, so a client's results do not depend on which clients share its call and an engine hosting
any part of a cohort computes the same bits. Each client's records stay its own: only the drawn
minibatches are stacked.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.func import vmap

from rfedray import aggregation
from rfedray.config import OptimizerConfig
from rfedray.federated.wire import from_arrays, to_arrays
from rfedray.geometry import ProductManifold
from rfedray.optim import build_optimizer
from rfedray.privacy.mechanism import (
    ClipShares, draw_step, noise_generator, nonprivate_gradient, private_gradient, rule_gradient,
)
from rfedray.privacy.randomness import SecureGenerator
from rfedray.privacy.plan import GaussianMechanism
from rfedray.task import ClientData, EvalData, FederatedModel, Params


@dataclass(frozen=True)
class LocalPlan:
    """What every client does in a round (identical across clients, public).

    Attributes
    ----------
    local_steps, batch_size : int
        tau and B.
    total_rounds : int
        T, for learning-rate schedules (the step index is ``round * tau + j``).
    mechanism : GaussianMechanism or None
        The private step's clip C and noise sigma (the run's privacy plan's); ``None`` for the
        non-private baseline.
    noise_seed : int or None
        ``None``: OS entropy. An integer makes the run reproducible and not for production.
    clip_shares : ClipShares or None
        Group-wise clipping, each group to its share of C (the same sensitivity); ``None``: joint.
    """

    local_steps: int
    batch_size: int
    total_rounds: int
    mechanism: Optional[GaussianMechanism]
    noise_seed: Optional[int] = None
    clip_shares: Optional[ClipShares] = None

    def __post_init__(self) -> None:
        if self.mechanism is not None and self.mechanism.batch_size != self.batch_size:
            raise ValueError(f"batch_size={self.batch_size}: the mechanism is accounted with "
                             f"batch_size={self.mechanism.batch_size}")

    @property
    def private(self) -> bool:
        return self.mechanism is not None

    def closed_form_rule(self, model: FederatedModel) -> Any:
        """The model's closed-form per-record gradients when this plan's steps use them (the private
        step of a model that has them), else None: the steps then go through ``torch.func`` (whose
        first call imports ``torch._dynamo``, seconds and ~70 MiB of a process)."""
        return model.gradient_rule if self.private else None


@dataclass
class LocalResult:
    """What leaves a client after a round: its submission and optimiser state (both privatised)."""

    submission: Params
    optimizer_state: dict[str, Any]
    train_seconds: float

    def __reduce__(self):
        # Sent to another process (a client actor's answer) with its tensors as numpy arrays
        # (rfedray.federated.wire): the same bits, at a fraction of torch's pickling cost.
        return (_received_result, (to_arrays(self.submission), to_arrays(self.optimizer_state), self.train_seconds))


def _received_result(submission: dict, optimizer_state: dict, train_seconds: float) -> LocalResult:
    return LocalResult(from_arrays(submission), from_arrays(optimizer_state), train_seconds)


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

    The only public ways to train are :meth:`local_train` and :func:`train_together` (several
    clients at once), which release privatised values only. A step's batch indices and noise (drawn
    in :func:`train_together` by :func:`~rfedray.privacy.mechanism.draw_step`) and its pieces
    (:meth:`_minibatch`, :meth:`_gradient`, :meth:`_result`) handle records, batch indices and
    noise: they are private to this module.

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

    def evaluate_test(self, theta: Params) -> Optional[tuple[int, dict[str, float]]]:
        """The number of records of this client's own test split and the model's metrics of ``theta``
        on it; ``None`` without a test split. For the process hosting the client: what leaves it is
        secret-shared (:mod:`rfedray.federated.evaluation`)."""
        test = self._data.test
        if not test or int(test[0].shape[0]) == 0:
            return None
        return int(test[0].shape[0]), self.model.evaluate(theta, EvalData(tuple(test)))

    def local_train(self, theta: Params, round_index: int, optimizer_state: Optional[dict] = None) -> LocalResult:
        """Run tau local steps from ``theta`` and return the scheme's submission: :func:`train_together`
        of this client alone, its gradient computed on its own (no ``vmap``, so that a model with an
        operation that has no batching rule trains too).

        Parameters
        ----------
        theta : dict of Tensor
            The broadcast model theta_t (not modified).
        round_index : int
            t, used for the learning-rate schedule and the seeded generator.
        optimizer_state : dict or None
            The state this client's optimisers ended the previous participation with.
        """
        return train_together([self], theta, round_index, [optimizer_state], vectorised=False)[0]

    def _load_optimizer_state(self, optimizer_state: Optional[dict]) -> None:
        """Restore the optimisers' state from a previous participation (``None``: fresh state)."""
        for name, opt in self._optimizers.items():
            opt.load_state_dict((optimizer_state or {}).get(name, {}))

    def _minibatch(self, index: Tensor) -> tuple[Tensor, ...]:
        """The records at ``index`` (shape ``(B,)``): each tensor of shape ``(B, ...)``."""
        return tuple(t.index_select(0, index) for t in self._data.train)

    def _gradient(self, params: Params, batch: tuple[Tensor, ...], noise: Optional[Params]) -> Params:
        """The step's tangent gradient at ``params``: privatised with ``noise``, or the plain mean.

        Draws no random numbers (they come from :func:`~rfedray.privacy.mechanism.draw_step`), so it
        can be vmapped over clients.
        """
        if self.plan.private:
            mechanism = self.plan.mechanism
            return private_gradient(
                self.model.per_sample_loss, params, self.product, batch,
                clip=mechanism.clip, sigma=mechanism.sigma, noise=noise, rule=self.plan.closed_form_rule(self.model),
                shares=self.plan.clip_shares,
            )
        return nonprivate_gradient(self.model.per_sample_loss, params, self.product, batch)

    def _gradients_of_clients(self, params: Params, batch: tuple[Tensor, ...], noise: Optional[Params]) -> Params:
        """:meth:`_gradient` of K clients sharing this client's model and plan, in one call: every
        input has a leading client dimension. With the model's closed-form per-record gradients
        the operations broadcast over it (:func:`rule_gradient`); otherwise ``vmap`` over clients."""
        rule = self.plan.closed_form_rule(self.model)
        if rule is not None:
            mechanism = self.plan.mechanism
            return rule_gradient(rule, params, self.product, batch, clip=mechanism.clip, sigma=mechanism.sigma,
                                 noise=noise, batch_size=self.plan.batch_size, shares=self.plan.clip_shares)
        return vmap(self._gradient, in_dims=(0, 0, 0 if self.plan.private else None))(params, batch, noise)

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


def state_signature(client: Client, optimizer_state: Optional[Mapping[str, Any]]) -> tuple:
    """What must agree between clients whose optimiser states are stacked.

    Parameters
    ----------
    client : Client
    optimizer_state : dict or None
        ``{group: {"optimizer": name, "state": {key: Tensor}}}`` from the client's previous
        participation (:meth:`~rfedray.optim.LocalOptimizer.state_dict` per group), or ``None``.

    Returns
    -------
    tuple
        Per group: the optimiser's name, then per state entry its key, shape and dtype, and its
        value when it is 0-dimensional (step counters, which optimisers read as Python numbers).
    """
    signature = []
    for name in client._optimizers:
        saved = (optimizer_state or {}).get(name) or {}
        entries = []
        for key, value in sorted(saved.get("state", {}).items()):
            t = torch.as_tensor(value)
            entries.append((key, tuple(t.shape), t.dtype, t.item() if t.dim() == 0 else None))
        signature.append((name, saved.get("optimizer"), tuple(entries)))
    return tuple(signature)


def batch_key(client: Client, optimizer_state: Optional[Mapping[str, Any]]) -> Hashable:
    """Clients with equal keys can be trained together by :func:`train_together`: one model object,
    one plan, and optimiser states of one structure (:func:`state_signature`)."""
    return id(client.model), client.plan, state_signature(client, optimizer_state)


def _stack_state(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One optimiser state for K clients: 0-dimensional entries, equal across the clients
    (:func:`batch_key`), stay one shared tensor; the others are stacked along a new leading dimension."""
    return {
        key: first if first.dim() == 0 else torch.stack([s[key] for s in states]) for key, first in states[0].items()
    }


def train_together(
    clients: Sequence[Client], theta: Params, round_index: int, states: Sequence[Optional[dict]],
    vectorised: bool = True,
) -> list[LocalResult]:
    """The tau local steps of K clients at once (K = 1: :meth:`Client.local_train`).

    Parameters
    ----------
    clients : sequence of Client
        K >= 1 clients sharing one model object and one plan, with equal :func:`batch_key`.
    theta : dict of Tensor
        theta_t, ``{g: (*shape_g)}`` (not modified).
    round_index : int
        t.
    states : sequence of dict or None
        Each client's optimiser state from its previous participation.
    vectorised : bool
        The K clients' gradients in one call (:meth:`Client._gradients_of_clients`); False computes
        each client's on its own slice, without ``vmap``.

    Returns
    -------
    list of LocalResult
        In the order of ``clients``; each ``train_seconds`` is the call's time divided by K.

    Raises
    ------
    ValueError
        If the clients do not share the model and plan, or their optimiser states cannot be stacked.
    """
    start = time.perf_counter()
    lead = clients[0]
    keys = {batch_key(c, s) for c, s in zip(clients, states)}
    if len(keys) != 1:
        raise ValueError(f"clients {[c.client_id for c in clients]}: only clients with one model, plan and "
                         "optimiser-state structure can be trained together")
    plan, k = lead.plan, len(clients)
    device = next(iter(theta.values())).device
    generators = [round_generator(plan.noise_seed, c.client_id, round_index, device) for c in clients]
    for c, s in zip(clients, states):
        c._load_optimizer_state(s)
    state = {name: _stack_state([c._optimizers[name].state for c in clients]) for name in lead._optimizers}
    params = {g: torch.stack([value] * k) for g, value in theta.items()}
    sizes = [c.num_records for c in clients]
    try:
        for j in range(plan.local_steps):
            # each client's minibatch, then its noise, from its own generator (the draws of the K
            # clients at once: the same bits as client by client)
            index, noise = draw_step(sizes, plan.batch_size, lead.product if plan.private else None, theta,
                                      generators)
            minibatches = [c._minibatch(rows) for c, rows in zip(clients, index)]
            batch = tuple(torch.stack(parts) for parts in zip(*minibatches))
            if vectorised:
                grad = lead._gradients_of_clients(params, batch, noise)
            else:
                parts = [c._gradient({g: v[i] for g, v in params.items()}, minibatches[i],
                                     None if noise is None else {g: n[i] for g, n in noise.items()})
                         for i, c in enumerate(clients)]
                grad = {g: torch.stack([p[g] for p in parts]) for g in theta}
            for name, opt in lead._optimizers.items():
                opt.state = state[name]
                params[name] = opt.step(params[name], grad[name], round_index * plan.local_steps + j)
                state[name] = opt.state
    finally:
        for opt in lead._optimizers.values():
            opt.state = {}
    # Each client's slices are copied out of the stacked tensors: a view would keep (and, sent to
    # another process, serialise) the storage of all K clients.
    results = []
    for i, c in enumerate(clients):
        for name, opt in c._optimizers.items():
            opt.state = {key: value if value.dim() == 0 else value[i].clone() for key, value in state[name].items()}
        results.append(c._result(theta, {g: value[i].clone() for g, value in params.items()}, start))
    seconds = (time.perf_counter() - start) / k
    return [dataclasses.replace(r, train_seconds=seconds) for r in results]
