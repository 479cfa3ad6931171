"""How the clients of a cohort are run: the engine behind the federation loop.

The loop (:mod:`rfedray.federated.loop`) only calls :meth:`Executor.train`. The local executor
runs the clients one after the other in this process; the Ray executor (``actors``) sends the
same calls to client actors. Both return, per client, a :class:`LocalResult` or a
:class:`ClientFailure`.
"""

from __future__ import annotations

import logging
from typing import Mapping, Protocol, Sequence

from rfedray.config import Config
from rfedray.federated.client import Client, ClientFailure, LocalPlan, LocalResult
from rfedray.federated.setup import build_client
from rfedray.task import FederatedDataset, FederatedModel, Params

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs the local training of a cohort."""

    def train(
        self, cohort: Sequence[int], theta: Params, round_index: int, states: Mapping[int, dict]
    ) -> dict[int, LocalResult | ClientFailure]:
        """Local training of every client of ``cohort`` from ``theta``."""

    def close(self) -> None:
        """Release the engine's resources."""


class LocalExecutor:
    """Every client in this process; a client's data is loaded the first time it is selected.

    Parameters
    ----------
    cfg : Config
    dataset : FederatedDataset
    model : FederatedModel
    plan : LocalPlan
    """

    def __init__(self, cfg: Config, dataset: FederatedDataset, model: FederatedModel, plan: LocalPlan):
        self.cfg, self.dataset, self.model, self.plan = cfg, dataset, model, plan
        self._clients: dict[int, Client] = {}

    def client(self, client_id: int) -> Client:
        if client_id not in self._clients:
            self._clients[client_id] = build_client(self.cfg, client_id, self.dataset, self.model, self.plan)
        return self._clients[client_id]

    def train(self, cohort, theta, round_index, states):
        results: dict[int, LocalResult | ClientFailure] = {}
        for cid in cohort:
            try:
                results[cid] = self.client(cid).local_train(theta, round_index, states.get(cid))
            except Exception as exc:  # a failing client is a dropout, never a crashed federation
                log.exception("client %d failed in round %d", cid, round_index)
                results[cid] = ClientFailure(type(exc).__name__)
        return results

    def close(self) -> None:
        self._clients.clear()
