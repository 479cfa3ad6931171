"""Client actors: Ray processes that host clients of a federation, and the pool that places them.

A :class:`ClientActor` hosts a fixed block of clients (sticky: a client never moves to another
actor, so its data never moves). It builds their data itself from the data spec of the
configuration, in its own process, so raw records never pass through the driver or the object
store. The clients of the cohort it hosts are trained together, one set of kernels for all of them
(:func:`rfedray.federated.client.train_together`), with the results of training them one by one. Its only
training method returns, per client, a
:class:`~rfedray.federated.client.LocalResult` (submission, optimiser state, train seconds: all
privatised) or a :class:`~rfedray.federated.client.ClientFailure`.

The clients of the core are stateless between rounds (optimiser state comes back with each result
and is kept by the server side; randomness is a function of ``(noise_seed, client, round)`` or OS
entropy), so an actor that Ray restarts (``ray.max_restarts``) or that the pool re-creates simply
rebuilds its clients and nothing is lost.

A :class:`TaskHostActor` is the same for the loops that hand their clients a client task
(M-estimation, DDP-SA: :mod:`rfedray.federated.engine`): a
:class:`~rfedray.federated.engine.ClientHost` of a sticky block of clients, built from a task spec
in its own process. What its clients keep between rounds (a DDP-SA client's clip threshold) lives
in the actor and starts afresh when Ray restarts it.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rfedray.config import Config, ConfigError, RayConfig
from rfedray.errors import RfedrayError
from rfedray.federated.client import ClientFailure, LocalPlan, LocalResult
from rfedray.federated.engine import ClientHost, TaskSpec
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.setup import build_dataset, build_model
from rfedray.task import ClientData
from rfedray.threads import use_threads

log = logging.getLogger(__name__)

ACTOR_START_TIMEOUT_S = 120.0
"""How long the pool waits for its placement group and its actors at start-up."""


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device`` (dicts, lists and tuples are walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def resolve_device(requested: str) -> torch.device:
    """The torch device of an actor: ``auto`` is its GPU when Ray gave it one, else the CPU.

    Raises
    ------
    RuntimeError
        For ``cuda`` on an actor without a visible CUDA device.
    """
    has_gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
    if requested == "cuda" and not has_gpu:
        raise RuntimeError("ray.device=cuda, but this client actor sees no CUDA device")
    return torch.device("cuda" if requested != "cpu" and has_gpu else "cpu")


class DeviceDataset:
    """A federated dataset whose client partitions are loaded onto ``device``."""

    def __init__(self, dataset, device: torch.device):
        self.dataset, self.device = dataset, device
        self.num_clients, self.info = dataset.num_clients, dataset.info

    def client_data(self, client_id: int) -> ClientData:
        data = self.dataset.client_data(client_id)
        return ClientData(to_device(data.train, self.device), to_device(data.test, self.device))


class ClientActor:
    """Hosts a block of clients and runs their local training (one Ray actor).

    Parameters
    ----------
    cfg : Config
        The run's configuration; the data and model are built from it here.
    client_ids : sequence of int
        The clients this actor hosts, for its whole life and every restart.
    plan : LocalPlan
        What every client does in a round.
    threads : int
        torch and BLAS threads of this process (:func:`rfedray.threads.choose_threads`).
    """

    def __init__(self, cfg: Config, client_ids: Sequence[int], plan: LocalPlan, threads: int):
        use_threads(threads)
        importlib.import_module("torch._dynamo")  # torch.func loads it on first use (seconds): not in round 0's deadline
        self.device = resolve_device(cfg.ray.device)
        dataset = build_dataset(cfg)
        if self.device.type != "cpu":
            dataset = DeviceDataset(dataset, self.device)
        self.client_ids = sorted(int(c) for c in client_ids)
        self._executor = LocalExecutor(cfg, dataset, build_model(cfg, dataset.info), plan)
        for cid in self.client_ids:
            self._executor.client(cid)

    def train(
        self, cohort: Sequence[int], theta: dict[str, torch.Tensor], round_index: int,
        states: Mapping[int, Optional[dict]],
    ) -> dict[int, LocalResult | ClientFailure]:
        """Local training of this actor's clients of the round's cohort.

        Parameters
        ----------
        cohort : sequence of int
            Clients of the cohort hosted here.
        theta : dict of Tensor
            theta_t (Ray resolves the round's single object-store copy).
        round_index : int
        states : mapping
            Each client's optimiser state from its previous participation.

        Returns
        -------
        dict
            Per client a LocalResult (tensors on the CPU) or a ClientFailure.
        """
        hosted = set(self.client_ids)
        results: dict[int, LocalResult | ClientFailure] = {
            cid: ClientFailure(f"client {cid} is not hosted by this actor") for cid in cohort if cid not in hosted
        }
        mine = [cid for cid in cohort if cid in hosted]
        states = {cid: to_device(states.get(cid), self.device) for cid in mine}
        trained = self._executor.train(mine, to_device(theta, self.device), round_index, states)
        cpu = torch.device("cpu")
        for cid, r in trained.items():
            if isinstance(r, LocalResult):
                r = LocalResult(to_device(r.submission, cpu), to_device(r.optimizer_state, cpu), r.train_seconds)
            results[cid] = r
        return results

    def describe(self) -> dict[str, Any]:
        """Where this actor runs: process, node, torch device and threads, hosted client ids."""
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "device": str(self.device),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "threads": torch.get_num_threads(),
            "clients": list(self.client_ids),
        }


RemoteClientActor = ray.remote(ClientActor)


class TaskHostActor(ClientHost):
    """Hosts a block of clients and runs the client tasks of a round on them (one Ray actor).

    Parameters
    ----------
    spec : TaskSpec
        Builds the data and the model here (records never travel).
    client_ids : sequence of int
        The clients this actor hosts, for its whole life and every restart; their data is built now.
    threads : int
        torch and BLAS threads of this process.
    """

    def __init__(self, spec: TaskSpec, client_ids: Sequence[int], threads: int):
        use_threads(threads)
        super().__init__(spec, client_ids)
        for cid in self.client_ids:
            self.client(cid)

    def describe(self) -> dict[str, Any]:
        """Where this actor runs: process, node, threads, hosted client ids."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "device": "cpu",
                "threads": torch.get_num_threads(), "clients": list(self.client_ids)}


RemoteTaskHostActor = ray.remote(TaskHostActor)


def assign_clients(n_clients: int, r: RayConfig, cluster_cpus: float) -> list[list[int]]:
    """Sticky blocks of client ids, one per client actor.

    ``ray.clients_per_actor`` > 0 makes blocks of that size; 0 spreads the clients evenly over
    ``ray.num_client_actors`` actors (default: as many as the cluster's CPUs hold at
    ``ray.num_cpus_per_actor`` each, at most ``n_clients``).

    Raises
    ------
    ConfigError
        If the two settings disagree or there would be more actors than clients.
    """
    if r.clients_per_actor > 0:
        actors = math.ceil(n_clients / r.clients_per_actor)
        if r.num_client_actors is not None and r.num_client_actors != actors:
            raise ConfigError(
                "ray.num_client_actors", r.num_client_actors,
                f"ray.clients_per_actor={r.clients_per_actor} with {n_clients} clients makes {actors} actors; "
                "set only one of the two",
            )
        return [list(range(a * r.clients_per_actor, min(n_clients, (a + 1) * r.clients_per_actor))) for a in range(actors)]
    actors = r.num_client_actors
    if actors is None:
        per_actor = r.num_cpus_per_actor if r.num_cpus_per_actor > 0 else 1.0
        actors = max(1, min(n_clients, int(cluster_cpus // per_actor)))
    if actors > n_clients:
        raise ConfigError("ray.num_client_actors", actors, f"must be at most federation.n_clients ({n_clients})")
    return [block.tolist() for block in np.array_split(np.arange(n_clients), actors)]


def check_capacity(r: RayConfig, actors: int, resources: Mapping[str, float]) -> None:
    """Refuse actor counts and sizes the cluster cannot host at all (instead of waiting for them).

    Raises
    ------
    ConfigError
        Naming the per-actor resource that the cluster's total cannot cover.
    """
    for resource, field in (("CPU", "ray.num_cpus_per_actor"), ("GPU", "ray.num_gpus_per_actor")):
        per_actor = getattr(r, field.split(".")[1])
        have = resources.get(resource, 0.0)
        if actors * per_actor > have + 1e-9:
            raise ConfigError(field, per_actor, f"{actors} client actors need {actors * per_actor:g} {resource} "
                              f"in all; the Ray cluster has {have:g} (lower it or ray.num_client_actors)")


class ClientPool:
    """The client actors of a run: placement, sticky blocks, start-up and re-creation.

    ``ray.placement: SPREAD`` schedules each actor with Ray's SPREAD strategy; ``PACK``,
    ``STRICT_PACK`` and ``STRICT_SPREAD`` reserve a placement group with one bundle per actor.

    Parameters
    ----------
    ray_cfg : RayConfig
        Placement, resources and restarts of the actors.
    blocks : list of list of int
        The clients of every actor (see :func:`assign_clients`).
    actor_class : ray actor class
        :data:`RemoteClientActor` or :data:`RemoteTaskHostActor`.
    **actor_args
        Its constructor's arguments besides ``client_ids`` (the slot's block).
    """

    def __init__(self, ray_cfg: RayConfig, blocks: list[list[int]], actor_class, **actor_args):
        self.ray_cfg, self.blocks, self.actor_class, self.actor_args = ray_cfg, blocks, actor_class, actor_args
        self.placement_group: Optional[PlacementGroup] = None
        if ray_cfg.placement != "SPREAD":
            self.placement_group = self._reserve()
        self.actors = [self._create(slot) for slot in range(len(blocks))]
        self.slot_of = {cid: slot for slot, block in enumerate(blocks) for cid in block}

    def _bundle(self) -> dict[str, float]:
        r = self.ray_cfg
        return {k: v for k, v in (("CPU", r.num_cpus_per_actor), ("GPU", r.num_gpus_per_actor)) if v > 0}

    def _reserve(self) -> PlacementGroup:
        bundle = self._bundle()
        if not bundle:
            raise ConfigError("ray.placement", self.ray_cfg.placement,
                              "a placement group needs ray.num_cpus_per_actor > 0 or ray.num_gpus_per_actor > 0")
        pg = placement_group([bundle] * len(self.blocks), strategy=self.ray_cfg.placement)
        try:
            ray.get(pg.ready(), timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RfedrayError(
                f"ray.placement={self.ray_cfg.placement}: the cluster cannot place {len(self.blocks)} bundles of "
                f"{bundle} within {ACTOR_START_TIMEOUT_S:.0f} s (resources: {ray.cluster_resources()})"
            ) from None
        return pg

    def _create(self, slot: int):
        r = self.ray_cfg
        strategy: Any = "SPREAD"
        if self.placement_group is not None:
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=slot)
        actor_cls = self.actor_class.options(
            num_cpus=r.num_cpus_per_actor, num_gpus=r.num_gpus_per_actor, max_restarts=r.max_restarts,
            max_task_retries=0, scheduling_strategy=strategy,
        )
        return actor_cls.remote(client_ids=self.blocks[slot], **self.actor_args)

    def wait_ready(self) -> list[dict]:
        """Block until every actor is up; return their :meth:`ClientActor.describe`.

        Raises
        ------
        RfedrayError
            If an actor fails to start or the cluster cannot host them all in time.
        """
        try:
            return ray.get([a.describe.remote() for a in self.actors], timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            r = self.ray_cfg
            raise RfedrayError(
                f"ray.num_client_actors: {len(self.actors)} client actors (num_cpus={r.num_cpus_per_actor}, "
                f"num_gpus={r.num_gpus_per_actor} each) did not start within {ACTOR_START_TIMEOUT_S:.0f} s; "
                f"the cluster has {ray.cluster_resources()}"
            ) from None
        except ray.exceptions.RayError as exc:
            detail = str(exc).strip().splitlines()
            raise RfedrayError(f"a client actor failed to start: {detail[-1] if detail else type(exc).__name__}") from None

    def recreate(self, slot: int) -> None:
        """Replace a permanently dead actor by a new one hosting the same clients.

        The new actor is scheduled when the cluster has room for it again; calls to it wait until
        then (and count as dropouts when they miss the round deadline).
        """
        ray.kill(self.actors[slot], no_restart=True)
        self.actors[slot] = self._create(slot)

    def group(self, cohort: Sequence[int]) -> dict[int, list[int]]:
        """The cohort's clients by the slot of the actor hosting them."""
        by_slot: dict[int, list[int]] = {}
        for cid in cohort:
            by_slot.setdefault(self.slot_of[cid], []).append(cid)
        return by_slot

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
