"""Where the per-client work of a Euclidean strategy runs: this process or Ray actors.

A strategy hands the engine a *client task*: a picklable callable
``task(client: HostedClient, theta, round_index) -> result`` that runs where the client's records
are. :class:`LocalEngine` calls it in this process; :class:`RayEngine` sends it to a pool of
plain ``ray.remote`` host actors, each of which builds its clients' partitions itself from a
:class:`TaskSpec` (records never travel) and keeps per-client state between rounds (sticky
assignment: client ``i`` lives on host ``i mod H``). Both return, per client, the task's result or
a :class:`rfedray.federated.client.ClientFailure`, like the project's
:class:`rfedray.federated.executor.Executor`.

The DP-RFedProj Ray layer (``actors``) runs :class:`rfedray.federated.client.Client` objects; the
strategies here need arbitrary per-client functions, so this module carries its own small pool.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence

from rfedray.federated.client import ClientFailure
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
    spec : TaskSpec
    client_ids : sequence of int
        The clients this host owns.
    dataset : FederatedDataset, optional
        An already built dataset (local engine); rebuilt from ``spec`` otherwise.
    """

    def __init__(self, spec: Optional[TaskSpec], client_ids: Sequence[int], dataset: Optional[FederatedDataset] = None,
                 model: Optional[FederatedModel] = None):
        self._dataset = dataset if dataset is not None else spec.build_dataset()
        self._model = model if model is not None else spec.build_model(self._dataset.info)
        self._owned = set(int(c) for c in client_ids)
        self._clients: dict[int, HostedClient] = {}

    def client(self, client_id: int) -> HostedClient:
        if client_id not in self._owned:
            raise ValueError(f"client_id={client_id}: not hosted here (hosts {sorted(self._owned)})")
        if client_id not in self._clients:
            self._clients[client_id] = HostedClient(client_id, self._dataset.client_data(client_id), self._model)
        return self._clients[client_id]

    def run(self, client_ids: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        results: dict[int, Any] = {}
        for cid in client_ids:
            try:
                results[cid] = task(self.client(cid), theta, round_index)
            except Exception as exc:  # a failing client is a dropout, never a crashed federation
                log.exception("client %d failed in round %d", cid, round_index)
                results[cid] = ClientFailure(f"{type(exc).__name__}: {exc}")
        return results

    def ping(self) -> bool:
        return True


class LocalEngine:
    """Every client in this process, on the dataset and model the caller already built."""

    def __init__(self, dataset: FederatedDataset, model: FederatedModel):
        self.host = ClientHost(None, range(dataset.num_clients), dataset, model)

    def run(self, cohort, task, theta, round_index):
        return self.host.run(list(cohort), task, theta, round_index)

    def close(self) -> None:
        self.host = None  # type: ignore[assignment]


class RayEngine:
    """Clients spread over ``num_hosts`` Ray actors (client ``i`` on host ``i mod num_hosts``).

    Parameters
    ----------
    spec : TaskSpec
        Rebuilt inside every actor.
    num_hosts : int
        Number of host actors, between 1 and ``spec.n_clients``.
    num_cpus_per_host : float
    address : str or None
        Ray cluster address; ``None`` starts (or joins) a local instance.
    timeout_s : float
        Deadline of a round's tasks; late or dead hosts count as failed clients.
    """

    def __init__(self, spec: TaskSpec, num_hosts: int = 2, num_cpus_per_host: float = 1.0,
                 address: Optional[str] = None, timeout_s: float = 300.0):
        import ray

        if not (1 <= num_hosts <= spec.n_clients):
            raise ValueError(f"num_hosts={num_hosts}: must be between 1 and n_clients ({spec.n_clients})")
        if not ray.is_initialized():
            # Like the main engine: the given cluster, else RAY_ADDRESS, else a new local instance (never
            # whatever cluster this machine last started, which ray.init(address=None) would join).
            address = address or os.environ.get("RAY_ADDRESS") or "local"
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        self.num_hosts = num_hosts
        self.timeout_s = timeout_s
        remote_host = ray.remote(num_cpus=num_cpus_per_host)(ClientHost)
        self.hosts = [
            remote_host.remote(spec, [c for c in range(spec.n_clients) if c % num_hosts == h])
            for h in range(num_hosts)
        ]
        ray.get([h.ping.remote() for h in self.hosts], timeout=timeout_s)

    def run(self, cohort, task, theta, round_index):
        import ray

        by_host: dict[int, list[int]] = {}
        for cid in cohort:
            by_host.setdefault(cid % self.num_hosts, []).append(cid)
        theta_ref = ray.put(theta)
        task_ref = ray.put(task)
        futures = {h: self.hosts[h].run.remote(ids, task_ref, theta_ref, round_index) for h, ids in by_host.items()}
        results: dict[int, Any] = {}
        for h, fut in futures.items():
            try:
                results.update(ray.get(fut, timeout=self.timeout_s))
            except Exception as exc:  # a lost host (or deadline) fails its clients, not the round
                log.warning("host %d failed in round %d: %s", h, round_index, exc)
                results.update({cid: ClientFailure(type(exc).__name__) for cid in by_host[h]})
        return results

    def close(self) -> None:
        import ray

        for h in self.hosts:
            ray.kill(h)
        self.hosts = []


def make_engine(engine: str, spec: TaskSpec, dataset: FederatedDataset, model: FederatedModel,
                num_hosts: int = 2, address: Optional[str] = None) -> Engine:
    """``"local"`` or ``"ray"``."""
    if engine == "local":
        return LocalEngine(dataset, model)
    if engine == "ray":
        return RayEngine(spec, num_hosts=min(num_hosts, spec.n_clients), address=address)
    raise ValueError(f"engine={engine!r}: must be local or ray")


