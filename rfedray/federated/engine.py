"""Where the per-client work of a round runs, for a loop that hands it a *client task*.

A client task is a picklable callable ``task(client: HostedClient, theta, round_index) -> release``
that runs where the client's records are and returns only what the client releases (a privatised
update, a receipt of secret shares). A :class:`ClientHost` holds some clients (the model, what each
keeps between rounds, the records of its latest round's clients) and runs tasks on them; an
:class:`Engine` runs a task on a cohort and answers every client with its release or a
:class:`~rfedray.federated.client.ClientFailure` (a client that raises is a dropout of the round,
never a crashed federation).

* :class:`LocalEngine`: one host of every client, in this process.
* ``actors.engine.ActorEngine``: hosts in client actors, each building its sticky block of
  clients' data itself from a :class:`TaskSpec` (records never travel), within the round deadline,
  restarted by Ray when they die (Ray lives in ``actors/`` only).

The M-estimation strategies (:mod:`rfedray.mestimation`) and DDP-SA (:mod:`rfedray.ddpsa`) run on
these engines (:func:`rfedray.federated.task_rounds.run_task_rounds`: their rounds on the federation loop,
charged to their privacy plan); DP-RFedProj's clients run on :mod:`rfedray.federated.executor` (a
:class:`ClientHost`) and its Ray executor, which also run the clients' evaluation as a client task.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from rfedray.errors import RfedrayError
from rfedray.federated.client import ClientFailure
from rfedray.federated.spill import SpilledDataset
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


def dropout(exc: BaseException, message: str, *args: object) -> ClientFailure:
    """The failure a client that raised ``exc`` answers: only the exception's type. Its message, which
    may quote records, goes with the traceback to the log of the process hosting the client."""
    log.exception(message, *args)
    return ClientFailure(type(exc).__name__)


class ClientHost:
    """Holds some clients and runs tasks on them: the local engine, the local executor and both kinds
    of client actor are hosts.

    A client's records are loaded (:meth:`client`) when a call needs them. Between calls a host keeps
    what its clients keep between rounds (:attr:`HostedClient.state`), the clients of its latest
    round (:meth:`hold`: with full participation every client, loaded once) and up to ``keep`` more,
    the most recently used. A host that lets clients go (``keep`` below its number of clients) loads
    each from the data source once and reads it back from a spill file of its process when it is
    sampled again, bit for bit the same (:class:`~rfedray.federated.spill.SpilledDataset`).

    Parameters
    ----------
    dataset : FederatedDataset
    model : FederatedModel
    client_ids : sequence of int
        The clients this host owns.
    keep : int
        Clients kept loaded beyond the latest round's, >= 0. A client actor keeps none (its memory
        is its latest cohort's records, not its whole block's); the local engine, one process with
        every client, keeps them all (a client sampled again costs no second load).
    """

    def __init__(self, dataset: FederatedDataset, model: FederatedModel, client_ids: Sequence[int], keep: int = 0):
        self.client_ids = sorted(int(c) for c in client_ids)
        self._owned = set(self.client_ids)
        if keep < 0:
            raise ValueError(f"keep={keep}: must be >= 0")
        self.keep = keep
        self.dataset = SpilledDataset(dataset) if keep < len(self.client_ids) else dataset
        self.model = model
        self._states: dict[int, dict] = {}
        self._held: OrderedDict[int, Any] = OrderedDict()  # least recently used first

    def build(self, client_id: int) -> Any:
        """A client task's view of a client (:class:`HostedClient`), with the state it keeps here."""
        return HostedClient(client_id, self.dataset.client_data(client_id), self.model,
                            self._states.setdefault(client_id, {}))

    def client(self, client_id: int) -> Any:
        """Client ``client_id`` with its records: the held one (:meth:`hold`), else loaded now (:meth:`build`)."""
        if client_id not in self._owned:
            raise ValueError(f"client_id={client_id}: not hosted here (hosts {sorted(self._owned)})")
        held = self._held.get(client_id)
        return held if held is not None else self.build(client_id)

    def load(self, client_ids: Sequence[int], log_name: str = "this process's log") -> None:
        """Load and check the records (training and test split) of every client of ``client_ids`` now,
        so that bad records stop the run before anything is charged; of them the ``keep`` most recent
        stay loaded, the others are let go.

        Raises
        ------
        RfedrayError
            rfedray's own message (it names a record by its index, never by its values), or, for
            any other error, only its type: the data's own message may quote records, so it goes to
            the log of the process hosting the client (``log_name`` says which).
        """
        for cid in client_ids:
            try:
                self._take(cid)
            except RfedrayError:
                raise
            except Exception as exc:
                log.exception("client %d: loading its records failed", cid)
                raise RfedrayError(f"client {cid}: {type(exc).__name__} while loading its records (its message is "
                                   f"in {log_name})") from None
            self._let_go(wanted=0)

    def hold(self, client_ids: Sequence[int]) -> None:
        """Keep the clients of ``client_ids`` (a round's cohort) loaded until the next round, and of the
        others the ``keep`` most recently used; one that cannot be loaded is left for the round to
        answer as a dropout."""
        wanted = 0
        for cid in dict.fromkeys(client_ids):
            try:
                self._take(cid)
            except Exception:  # the round loads it again and turns the error into a dropout
                continue
            wanted += 1
        self._let_go(wanted)

    def _take(self, client_id: int) -> None:
        """Hold client ``client_id`` as the most recently used, loading it if it is not held."""
        held = self._held.pop(client_id, None)
        self._held[client_id] = self.client(client_id) if held is None else held

    def _let_go(self, wanted: int) -> None:
        """Let go the least recently used clients beyond the ``wanted`` most recent and ``keep`` more."""
        while len(self._held) > wanted + self.keep:
            self._held.popitem(last=False)

    def run(self, client_ids: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        """``task`` on each of ``client_ids`` (clients of this host, held until the next call): its
        release or a ClientFailure."""
        self.hold(client_ids)
        return self.run_each(client_ids, task, theta, round_index)

    def run_each(self, client_ids: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        """:meth:`run` without holding the clients: those not held are loaded for this call only."""
        results: dict[int, Any] = {}
        for cid in client_ids:
            try:
                results[cid] = task(self.client(cid), theta, round_index)
            except Exception as exc:  # a failing client is a dropout, never a crashed federation
                results[cid] = dropout(exc, "client %d failed in round %d", cid, round_index)
        return results

    def close(self) -> None:
        self._held.clear()
        self._states.clear()
        if isinstance(self.dataset, SpilledDataset):
            self.dataset.close()


class LocalEngine(ClientHost):
    """Every client in this process, on the dataset and model the caller already built: one host of
    all, keeping every client it has loaded."""

    def __init__(self, dataset: FederatedDataset, model: FederatedModel):
        super().__init__(dataset, model, range(dataset.num_clients), keep=dataset.num_clients)


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
