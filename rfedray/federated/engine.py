"""Where the per-client work of a round runs, for a loop that hands it a *client task*.

A client task is a picklable callable ``task(client: HostedClient, theta, round_index) -> release``
that runs where the client's records are and returns only what the client releases (a privatised
update, a receipt of secret shares). A :class:`ClientHost` holds some clients (their records, the
model, what each keeps between rounds) and runs tasks on them; an :class:`Engine` runs a task on a
cohort and answers every client with its release or a
:class:`~rfedray.federated.client.ClientFailure` (a client that raises is a dropout of the round,
never a crashed federation).

* :class:`LocalEngine`: one host of every client, in this process.
* ``actors.engine.RayTaskEngine``: hosts in client actors, each building its sticky block of
  clients' data itself from a :class:`TaskSpec` (records never travel), within the round deadline,
  restarted by Ray when they die (Ray lives in ``actors/`` only).

The M-estimation strategies (:mod:`rfedray.mestimation`) and DDP-SA (:mod:`rfedray.ddpsa`) run on
these engines (:func:`run_task_rounds`: their rounds on the federation loop, charged to their privacy
plan); DP-RFedProj's clients run on :mod:`rfedray.federated.executor` and its Ray executor.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from rfedray.federated.client import ClientFailure
from rfedray.federated.rounds import Outcome, Strategy, run_rounds
from rfedray.privacy.plan import PrivacyPlan
from rfedray.privacy.statement import statement
from rfedray.task import ClientData, FederatedDataset, FederatedModel, Params

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSpec:
    """How any process rebuilds the task: a data module and a model module with their options.

    Attributes
    ----------
    data_module, model_module : str
        Importable modules with ``Options`` and ``build`` (e.g. ``rfedray.data.sklearn_data``).
    data_options, model_options : dict
        Keyword arguments of their ``Options``.
    n_clients, seed : int
    """

    data_module: str
    model_module: str
    data_options: Mapping[str, Any]
    model_options: Mapping[str, Any]
    n_clients: int
    seed: int

    def build_dataset(self) -> FederatedDataset:
        module = importlib.import_module(self.data_module)
        return module.build(module.Options(**dict(self.data_options)), n_clients=self.n_clients, seed=self.seed)

    def build_model(self, info: dict) -> FederatedModel:
        module = importlib.import_module(self.model_module)
        return module.build(module.Options(**dict(self.model_options)), info)


@dataclass
class HostedClient:
    """A client as its task sees it: id, records, model and the state it keeps between rounds."""

    client_id: int
    data: ClientData
    model: FederatedModel
    state: dict = field(default_factory=dict)


class ClientTask(Protocol):
    """Per-client work of one round; must be picklable for the Ray engine."""

    def __call__(self, client: HostedClient, theta: Params, round_index: int) -> Any: ...


class Engine(Protocol):
    """Runs a client task on a cohort."""

    def run(self, cohort: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        """``{client_id: result or ClientFailure}`` for every client of ``cohort``."""

    def close(self) -> None: ...


class ClientHost:
    """Holds some clients' partitions and states, and runs tasks on them (in-process or as an actor).

    Parameters
    ----------
    spec : TaskSpec or None
        Builds the dataset and the model (unused when both are given).
    client_ids : sequence of int
        The clients this host owns; a client's data is loaded the first time it is asked for.
    dataset : FederatedDataset, optional
        An already built dataset (local engine); rebuilt from ``spec`` otherwise.
    """

    def __init__(self, spec: Optional[TaskSpec], client_ids: Sequence[int], dataset: Optional[FederatedDataset] = None,
                 model: Optional[FederatedModel] = None):
        self._dataset = dataset if dataset is not None else spec.build_dataset()
        self._model = model if model is not None else spec.build_model(self._dataset.info)
        self.client_ids = sorted(int(c) for c in client_ids)
        self._owned = set(self.client_ids)
        self._clients: dict[int, HostedClient] = {}

    def client(self, client_id: int) -> HostedClient:
        if client_id not in self._owned:
            raise ValueError(f"client_id={client_id}: not hosted here (hosts {sorted(self._owned)})")
        if client_id not in self._clients:
            self._clients[client_id] = HostedClient(client_id, self._dataset.client_data(client_id), self._model)
        return self._clients[client_id]

    def run(self, client_ids: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        """``task`` on each of ``client_ids`` (clients of this host): its release or a ClientFailure."""
        results: dict[int, Any] = {}
        for cid in client_ids:
            try:
                results[cid] = task(self.client(cid), theta, round_index)
            except Exception as exc:  # a failing client is a dropout, never a crashed federation
                log.exception("client %d failed in round %d", cid, round_index)
                results[cid] = ClientFailure(type(exc).__name__)  # the type only: its message may hold records
        return results


class LocalEngine(ClientHost):
    """Every client in this process, on the dataset and model the caller already built: one host of all."""

    def __init__(self, dataset: FederatedDataset, model: FederatedModel):
        super().__init__(None, range(dataset.num_clients), dataset, model)

    def close(self) -> None:
        self._clients.clear()


def check_task_run(sizes: Sequence[int], clients_per_round: int, batch_size: int, rounds: int,
                   fewest: int = 1) -> None:
    """Refuse a run of ``rounds`` rounds of ``clients_per_round`` clients (at least ``fewest``) drawing
    ``batch_size`` records from clients of ``sizes`` records (a ValueError naming the argument)."""
    if not fewest <= clients_per_round <= len(sizes):
        raise ValueError(f"clients_per_round={clients_per_round}: must be between {fewest} and n_clients ({len(sizes)})")
    if not 1 <= batch_size <= min(sizes):
        raise ValueError(f"batch_size={batch_size}: must be between 1 and the smallest client's record count ({min(sizes)})")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: must be >= 1")


def run_task_rounds(strategy: Strategy, plan: PrivacyPlan, theta: Params, sizes: Sequence[int], *, rounds: int,
                    seed: int, clients_per_round: int,
                    on_round: Optional[Callable[[dict], None]] = None) -> tuple[Outcome, dict]:
    """Rounds ``0 .. rounds - 1`` of a client-task ``strategy`` on the federation loop, charged to
    ``plan.ledger(sizes)``; the outcome and the summary every such run writes (rounds, halt, the
    privacy spent and what it covers, wall time), which the system completes.

    ``on_round`` receives every round's record.
    """
    ledger = plan.ledger(sizes)
    started = time.perf_counter()
    outcome = run_rounds(strategy, ledger, theta, first=0, last=rounds, seed=seed, n_clients=len(sizes),
                         clients_per_round=clients_per_round,
                         on_round=None if on_round is None else lambda record, theta, auth: on_round(record))
    private = plan.private
    return outcome, {
        "rounds_completed": outcome.rounds_completed, "rounds_planned": rounds,
        "halted": outcome.halted, "halt_reason": outcome.halt_reason,
        "epsilon_target": plan.epsilon_target, "delta": plan.delta if private else None,
        "epsilon_spent": ledger.epsilon_spent(), "accountant": plan.accountant if private else None,
        **(statement() if private else {}), "not_for_production": private and plan.noise_seed is not None,
        "wall_seconds": time.perf_counter() - started,
    }
