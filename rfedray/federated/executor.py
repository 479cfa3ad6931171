"""How the clients of a cohort are run: the engine behind the federation loop.

The loop (:mod:`rfedray.federated.loop`) calls :meth:`Executor.train` and, to evaluate on the
clients' own test splits, :meth:`Executor.run` (:mod:`rfedray.federated.evaluation`). The local executor
runs the clients in this process, several at once where their optimiser states allow it
(:func:`~rfedray.federated.client.train_together`); the Ray executor (``actors``) sends the same calls to client
actors, each of which runs a local executor over its own clients. Both return, per client, a
:class:`LocalResult` or a :class:`ClientFailure`.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Protocol, Sequence

from rfedray.config import Config
from rfedray.ddpsa.secure_aggregation import AggregatorGroup, LocalAggregators
from rfedray.federated.client import Client, ClientFailure, LocalPlan, LocalResult, batch_key, train_together
from rfedray.federated.engine import ClientHost, ClientTask, Engine, dropout
from rfedray.federated.evaluation import NUM_AGGREGATORS
from rfedray.federated.setup import build_client
from rfedray.task import FederatedDataset, FederatedModel, Params

log = logging.getLogger(__name__)

MOST_TOGETHER = 16
"""Most clients trained in one call of :func:`~rfedray.federated.client.train_together`: a larger group
is trained in parts of at most this many, with the same bits (a client's results do not depend on
which clients share the call). The working set of ``vmap(grad)`` grows with the clients of a call:
SPDNet's client actors at n = 500 (50 clients of a round each, B = 64) grew from 344 MiB after
start to 490-515 MiB training all 50 together. 16 keeps the batched speed-up of 10 clients."""


class Executor(Engine, Protocol):
    """Runs the local training of a cohort; its :meth:`~rfedray.federated.engine.Engine.run` runs a
    client task where each client is hosted (the evaluation on the clients' test splits,
    :mod:`rfedray.federated.evaluation`; a client that raises answers a ClientFailure)."""

    def train(
        self, cohort: Sequence[int], theta: Params, round_index: int, states: Mapping[int, dict]
    ) -> dict[int, LocalResult | ClientFailure]:
        """Local training of every client of ``cohort`` from ``theta``."""

    def share_aggregators(self) -> AggregatorGroup:
        """The secure-aggregation group the clients' shares go to (closed with the engine)."""


class LocalExecutor(ClientHost):
    """Clients in this process (a :class:`~rfedray.federated.engine.ClientHost` of :class:`Client` s);
    the clients of the latest training round (and ``keep`` more) stay loaded
    (:meth:`~rfedray.federated.engine.ClientHost.hold`), any other is loaded when a call needs it,
    and every client's data is checked at once by :meth:`load`.

    The clients of a cohort are grouped by the structure of their optimiser states
    (:func:`~rfedray.federated.client.batch_key`) and each group is trained together by
    :func:`~rfedray.federated.client.train_together`, a lone client as a group of one: its
    results do not depend on which other clients share the call, so the local engine and client
    actors hosting any part of a cohort compute the same bits. A group whose batched training
    raises is trained one by one with :meth:`Client.local_train` (a client that fails then is a
    dropout of the round).

    Parameters
    ----------
    cfg : Config
    dataset : FederatedDataset
    model : FederatedModel
    plan : LocalPlan
    vectorise : bool
        Train through :func:`~rfedray.federated.client.train_together` (default); ``False`` runs
        :meth:`Client.local_train` client after client (the kernel's one-client case, without ``vmap``).
    client_ids : sequence of int, optional
        The clients hosted here (a client actor's block); every client of the federation by default.
    keep : int
        Clients kept loaded beyond the latest round's (:class:`~rfedray.federated.engine.ClientHost`).
    """

    def __init__(self, cfg: Config, dataset: FederatedDataset, model: FederatedModel, plan: LocalPlan,
                 vectorise: bool = True, client_ids: Optional[Sequence[int]] = None, keep: int = 0):
        super().__init__(dataset, model, range(cfg.federation.n_clients) if client_ids is None else client_ids, keep)
        self.cfg, self.plan, self.vectorise = cfg, plan, vectorise
        self._declared: Optional[list[int]] = None
        self._aggregators: Optional[LocalAggregators] = None

    def build(self, client_id: int) -> Client:
        if self._declared is None:
            self._declared = [int(m) for m in self.dataset.client_sizes()]
        return build_client(self.cfg, client_id, self.dataset, self.model, self.plan, self._declared[client_id])

    def run(self, client_ids: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        """A client task on ``client_ids`` (the evaluation on the clients' test splits): the clients of
        the latest training round are held, the others loaded for this call only."""
        return self.run_each(client_ids, task, theta, round_index)

    def train(self, cohort, theta, round_index, states):
        results: dict[int, LocalResult | ClientFailure] = {}
        clients: dict[int, Client] = {}
        self.hold(cohort)
        groups: dict[object, list[int]] = {}
        for cid in cohort:
            try:
                clients[cid] = self.client(cid)
                key = batch_key(clients[cid], states.get(cid)) if self.vectorise else cid
            except Exception as exc:  # a failing client is a dropout, never a crashed federation
                results[cid] = dropout(exc, "client %d failed in round %d", cid, round_index)
                continue
            groups.setdefault(key, []).append(cid)
        parts = [group[i:i + MOST_TOGETHER] for group in groups.values() for i in range(0, len(group), MOST_TOGETHER)]
        for members in parts:
            if self.vectorise:
                try:
                    trained = train_together([clients[c] for c in members], theta, round_index,
                                             [states.get(c) for c in members])
                    results.update(zip(members, trained))
                    continue
                except Exception:
                    log.warning("round %d: clients %s could not be trained together; training them one by one",
                                round_index, members, exc_info=True)
            for cid in members:
                results[cid] = self._train_one(clients[cid], theta, round_index, states.get(cid))
        return {cid: results[cid] for cid in cohort}

    def _train_one(self, client: Client, theta: Params, round_index: int, state) -> LocalResult | ClientFailure:
        """:meth:`Client.local_train` of one client; a client that raises is a dropout."""
        try:
            return client.local_train(theta, round_index, state)
        except Exception as exc:  # a failing client is a dropout, never a crashed federation
            return dropout(exc, "client %d failed in round %d", client.client_id, round_index)

    def share_aggregators(self) -> AggregatorGroup:
        if self._aggregators is None:
            self._aggregators = LocalAggregators(NUM_AGGREGATORS)
        return self._aggregators
