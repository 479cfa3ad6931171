"""Several clients of one round trained together: one set of kernels instead of a loop over clients.

The clients hosted by one executor (the local engine, or a client actor of the Ray engine) share the
model, the local plan and the optimiser configuration, and start a round from the same theta_t. Their
tau local steps are then the same computation on different minibatches, noise and optimiser states,
so :func:`train_together` runs each step once for all of them: the gradient is computed over a
leading client dimension of the parameters, minibatches and noise (broadcasting through the model's
closed-form per-record gradients where it has them, else ``torch.func.vmap`` over clients, so that
per-sample gradients become one ``vmap`` over clients and records), and the optimisers step the
stacked parameters and states directly (manifold operations broadcast over leading dimensions, and the learning rate is
the same for every client of the round).

The randomness is exactly the one-by-one randomness: every client draws its minibatch indices and
its noise from its own generator (:func:`~rfedray.federated.client.round_generator`), in the order
:meth:`~rfedray.federated.client.Client.local_train` does (:meth:`~rfedray.federated.client.Client._draw_step`);
only the arithmetic that follows is batched. Clients can be trained together when their optimiser
states have the same structure (:func:`batch_key`): the same entries with the same shapes, and
equal 0-dimensional entries (step counters, which optimisers read as Python numbers); the other
entries have the shape of their parameter and are stacked. Each client's records stay its own:
only the drawn minibatches are stacked.

A client's results do not depend on the other clients of the call: every batched kernel computes
each client's slice as it would for that client alone, so an executor hosting any part of a cohort
gives the same bits. They equal :meth:`~rfedray.federated.client.Client.local_train`'s bit for bit
where the matrix products are large enough for BLAS on both paths (the paper's shapes); for tiny
matrices torch's CPU ``bmm`` sums in another order than ``mm`` (a few float32 ulps).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from rfedray.federated.client import Client, LocalResult, round_generator
from rfedray.task import Params


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
        value when it is 0-dimensional.
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
    """Clients with equal keys can be trained together by :func:`train_together`.

    Parameters
    ----------
    client : Client
    optimizer_state : dict or None
        The state the client starts the round with.
    """
    return id(client.model), client.plan, state_signature(client, optimizer_state)


def _stack_state(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One optimiser state for K clients: 0-dimensional entries, equal across the clients
    (:func:`batch_key`), stay one shared tensor; the others are stacked along a new leading dimension."""
    return {
        key: first if first.dim() == 0 else torch.stack([s[key] for s in states]) for key, first in states[0].items()
    }


def train_together(
    clients: Sequence[Client], theta: Params, round_index: int, states: Sequence[Optional[dict]]
) -> list[LocalResult]:
    """Local training of several clients at once; the same results as their ``local_train`` one by one.

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

    Returns
    -------
    list of LocalResult
        In the order of ``clients``; each ``train_seconds`` is the batch's time divided by K.

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
    try:
        for j in range(plan.local_steps):
            draws = [c._draw_step(theta, gen) for c, gen in zip(clients, generators)]
            minibatches = [c._minibatch(index) for c, (index, _) in zip(clients, draws)]
            batch = tuple(torch.stack(parts) for parts in zip(*minibatches))
            noise = {g: torch.stack([n[g] for _, n in draws]) for g in theta} if plan.private else None
            grad = lead._gradients_of_clients(params, batch, noise)
            for name, opt in lead._optimizers.items():
                opt.state = state[name]
                params[name] = opt.step(params[name], grad[name], round_index * plan.local_steps + j)
                state[name] = opt.state
    finally:
        for opt in lead._optimizers.values():
            opt.state = {}
    results = []
    for i, c in enumerate(clients):
        for name, opt in c._optimizers.items():
            opt.state = {key: value if value.dim() == 0 else value[i] for key, value in state[name].items()}
        results.append(c._result(theta, {g: value[i] for g, value in params.items()}, start))
    seconds = (time.perf_counter() - start) / k
    return [dataclasses.replace(r, train_seconds=seconds) for r in results]
