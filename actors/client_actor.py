"""Client actors: Ray processes that host clients of a federation, and the pool that places them.

A :class:`ClientActor` hosts a fixed block of clients (sticky: a client never moves to another
actor, so its data never moves). It builds their data itself from the data spec of the
configuration, in its own process, so raw records never pass through the driver or the object
store. The clients of the cohort it hosts are trained together, one set of kernels for all of them
(:func:`rfedray.federated.client.train_together`), with the results of training them one by one. Its only
training method returns, per client, a
:class:`~rfedray.federated.client.LocalResult` (submission, optimiser state, train seconds: all
privatised) or a :class:`~rfedray.federated.client.ClientFailure`; its ``run`` of the evaluation task sends
the secret shares of its clients' test metrics to the aggregators (:mod:`rfedray.federated.evaluation`).

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

from actors.cluster import ClusterShape, ClusterWait, actor_bundle
from rfedray.config import Config, ConfigError, RayConfig
from rfedray.cuda import cuda_report
from rfedray.ddpsa.runner import DDPSATask
from rfedray.errors import RfedrayError
from rfedray.federated.client import ClientFailure, LocalPlan, LocalResult
from rfedray.federated.engine import ClientHost, TaskSpec
from rfedray.federated.evaluation import EvaluationTask
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.setup import GivenTask, build_dataset, build_model
from rfedray.federated.wire import from_arrays, map_tree
from rfedray.mestimation.strategies import GradientTask, LocalNewtonTask, LocalSGDTask
from rfedray.task import ClientData
from rfedray.threads import use_threads

log = logging.getLogger(__name__)

def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device`` (dicts, lists and tuples are walked)."""
    return map_tree(obj, torch.Tensor, lambda tensor: tensor.to(device))


def resolve_device(requested: str) -> torch.device:
    """The torch device of an actor: ``auto`` is its GPU when Ray gave it one, else the CPU.

    An actor that Ray gave a GPU never trains on the CPU instead: when torch cannot use the GPU
    (a CPU-only torch, or a driver older than torch's CUDA build), it refuses to start.

    Raises
    ------
    RfedrayError
        For ``auto`` or ``cuda`` when Ray assigned this actor a GPU that torch cannot use, and for
        ``cuda`` on an actor without a GPU; the message gives torch's CUDA build, the NVIDIA
        driver's version and the CUDA version that driver supports.
    """
    cpu = torch.device("cpu")
    if requested == "cpu":
        return cpu
    gpus = [str(g) for g in ray.get_gpu_ids()]
    if gpus and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    node = ray.get_runtime_context().get_node_id()[:12]
    if gpus:
        raise RfedrayError(
            f"ray.device={requested}: Ray assigned GPU {', '.join(gpus)} to this client actor (node {node}), but "
            f"torch cannot use it: {cuda_report()}. Use a node image whose driver supports torch's CUDA "
            "(deploy/README.md), or ray.device=cpu with ray.num_gpus_per_actor=0"
        )
    if requested == "cuda":
        raise RfedrayError(f"ray.device=cuda: this client actor (node {node}) has no GPU from Ray; "
                           f"ray.num_gpus_per_actor must be > 0 ({cuda_report()})")
    return cpu


class DeviceDataset:
    """A federated dataset whose client partitions are loaded onto ``device``."""

    def __init__(self, dataset, device: torch.device):
        self.dataset, self.device = dataset, device
        self.num_clients, self.info = dataset.num_clients, dataset.info

    def client_data(self, client_id: int) -> ClientData:
        data = self.dataset.client_data(client_id)
        return ClientData(to_device(data.train, self.device), to_device(data.test, self.device))

    def client_sizes(self) -> list[int]:
        return self.dataset.client_sizes()


CLIENT_LOG = "the client actor's log, on the client's node"
"""Where a client actor's data errors keep their own message (the server learns only their type)."""

EVALUATION_TASKS = (EvaluationTask,)
"""What :meth:`ClientActor.run` runs: the evaluation on the clients' test splits (training is
:meth:`ClientActor.train`)."""
SYSTEM_TASKS = (GradientTask, LocalSGDTask, LocalNewtonTask, DDPSATask)
"""What :meth:`TaskHostActor.run` runs: the client tasks of M-estimation's strategies and of DDP-SA."""


def protocol_task(task: Any, allowed: tuple[type, ...], actor: str) -> Any:
    """``task`` when its type is one of ``allowed`` (exactly: a subclass may run other code), else
    refused before it runs.

    A client actor runs, on its clients' records, only the tasks of the protocol it takes part in:
    the code of a task sent through Ray is the sender's, and a task of another type could release
    what the protocol never does (a record, a client's unclipped gradient).

    Raises
    ------
    RfedrayError
        Naming the refused type and the allowed ones (nothing of the clients in it).
    """
    kind = type(task)
    if kind not in allowed:
        raise RfedrayError(f"{actor}.run refuses a task of type {kind.__module__}.{kind.__qualname__}: it runs only "
                           f"the protocol's tasks ({', '.join(t.__qualname__ for t in allowed)})")
    return task


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
    given : GivenTask, optional
        The user's model or dataset objects (pickled to this actor), used instead of the
        configuration's; the dataset's clients are loaded here all the same.
    """

    def __init__(self, cfg: Config, client_ids: Sequence[int], plan: LocalPlan, threads: int,
                 given: Optional[GivenTask] = None):
        use_threads(threads)
        self.device = resolve_device(cfg.ray.device)
        dataset = build_dataset(cfg, given)
        if self.device.type != "cpu":
            dataset = DeviceDataset(dataset, self.device)
        self.client_ids = sorted(int(c) for c in client_ids)
        model = build_model(cfg, dataset.info, given)
        if plan.closed_form_rule(model) is None:
            # torch.func imports torch._dynamo on first use (seconds): here, not in round 0's deadline.
            # A step with closed-form per-record gradients never does (~70 MiB less per actor).
            importlib.import_module("torch._dynamo")
        self._executor = LocalExecutor(cfg, dataset, model, plan, client_ids=self.client_ids)
        # A data error's own message stays in this actor's log, on the client's node; the server (and the
        # error of the run) learns only its type.
        self._executor.load(self.client_ids, CLIENT_LOG)

    def train(
        self, cohort: Sequence[int], theta: dict[str, torch.Tensor], round_index: int,
        states: Mapping[int, Optional[dict]],
    ) -> dict[int, LocalResult | ClientFailure]:
        """Local training of this actor's clients of the round's cohort.

        Parameters
        ----------
        cohort : sequence of int
            Clients of the cohort hosted here.
        theta : dict of Tensor or Array
            theta_t (Ray resolves the round's single object-store copy), its tensors as
            :class:`~rfedray.federated.wire.Array` s or tensors.
        round_index : int
        states : mapping
            Each client's optimiser state from its previous participation (tensors or Arrays).

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
        states = {cid: to_device(from_arrays(states.get(cid)), self.device) for cid in mine}
        trained = self._executor.train(mine, to_device(from_arrays(theta), self.device), round_index, states)
        cpu = torch.device("cpu")
        for cid, r in trained.items():
            if isinstance(r, LocalResult):
                r = LocalResult(to_device(r.submission, cpu), to_device(r.optimizer_state, cpu), r.train_seconds)
            results[cid] = r
        return results

    def run(self, client_ids: Sequence[int], task, theta: dict[str, torch.Tensor], round_index: int) -> dict[int, Any]:
        """``task`` (:class:`~rfedray.federated.evaluation.EvaluationTask`, refused otherwise) on the
        clients of ``client_ids`` hosted here, each on its own test split: per client what the task
        answers (its metrics' names; the values leave as secret shares only) or a ClientFailure."""
        task = protocol_task(task, EVALUATION_TASKS, "ClientActor")
        return self._executor.run(client_ids, task, to_device(theta, self.device), round_index)

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


class TaskHostActor:
    """Hosts a block of clients and runs the client tasks of a round on them (one Ray actor).

    The actor holds a :class:`ClientHost` and answers only ``run`` (what the task releases),
    ``describe`` and ``close``: the host's ``client`` and ``build``, which return a client with its
    records, are not methods of the actor.

    Parameters
    ----------
    spec : TaskSpec
        Builds the data and the model here (records never travel).
    client_ids : sequence of int
        The clients this actor hosts, for its whole life and every restart; their data is built and
        checked now, and read back from the actor's spill file when a round samples them
        (:meth:`ClientHost.hold`).
    threads : int
        torch and BLAS threads of this process.
    """

    def __init__(self, spec: TaskSpec, client_ids: Sequence[int], threads: int):
        use_threads(threads)
        dataset = spec.build_dataset()
        self._host = ClientHost(dataset, spec.build_model(dataset.info), client_ids)
        self._host.load(self._host.client_ids, CLIENT_LOG)

    def run(self, client_ids: Sequence[int], task: Any, theta: Any, round_index: int) -> dict[int, Any]:
        """``task`` (one of :data:`SYSTEM_TASKS`, refused otherwise) on each of ``client_ids``: its release,
        or a ClientFailure (:meth:`ClientHost.run`)."""
        return self._host.run(client_ids, protocol_task(task, SYSTEM_TASKS, "TaskHostActor"), theta, round_index)

    def close(self) -> None:
        self._host.close()

    def describe(self) -> dict[str, Any]:
        """Where this actor runs: process, node, threads, hosted client ids."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "device": "cpu",
                "threads": torch.get_num_threads(), "clients": list(self._host.client_ids)}


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


class ClientPool:
    """The client actors of a run: placement, sticky blocks, start-up and re-creation.

    ``ray.placement: SPREAD`` schedules each actor with Ray's SPREAD strategy; ``PACK``,
    ``STRICT_PACK`` and ``STRICT_SPREAD`` reserve a placement group with one bundle per actor.
    Start-up waits for the cluster (and, on an autoscaling cluster, for the nodes the autoscaler
    adds) until ``ray.actor_start_timeout_s``: see :class:`actors.cluster.ClusterWait`.

    Parameters
    ----------
    cfg : Config
        Its ``ray`` section: placement, resources, restarts and start-up deadline of the actors.
    blocks : list of list of int
        The clients of every actor (see :func:`assign_clients`).
    shape : ClusterShape
        The cluster, already checked to be able to host the actors (:meth:`ClusterShape.check`).
    actor_class : ray actor class
        :data:`RemoteClientActor` or :data:`RemoteTaskHostActor`.
    actor_args : dict
        Its constructor's arguments besides ``client_ids`` (the slot's block).
    runtime_env : dict, optional
        Ray runtime environment of the actors (the user's code, :func:`actors.session.user_code_env`).
    """

    def __init__(self, cfg: Config, blocks: list[list[int]], shape: ClusterShape, actor_class, actor_args: dict,
                 runtime_env: Optional[dict] = None):
        self.cfg, self.blocks, self.actor_class, self.actor_args = cfg, blocks, actor_class, actor_args
        self.runtime_env = runtime_env
        self.placement_group: Optional[PlacementGroup] = None
        self.slot_of = {cid: slot for slot, block in enumerate(blocks) for cid in block}
        self.startup = ClusterWait(cfg, len(blocks), shape)
        self.actors: list = []
        try:
            if cfg.ray.placement != "SPREAD":
                self.placement_group = self._reserve()
            self.actors = [self._create(slot) for slot in range(len(blocks))]
        except BaseException:
            self.startup.done()
            raise

    def _reserve(self) -> PlacementGroup:
        bundle = actor_bundle(self.cfg)
        ConfigError.check(bundle, "ray.placement", self.cfg.ray.placement,
                          "a placement group needs ray.num_cpus_per_actor > 0 or ray.num_gpus_per_actor > 0")
        pg = placement_group([bundle] * len(self.blocks), strategy=self.cfg.ray.placement)
        try:
            self.startup.gather([pg.ready()], f"placement group (ray.placement={self.cfg.ray.placement})",
                                bundles_per_ref=len(self.blocks))
        except BaseException:
            remove_placement_group(pg)
            raise
        return pg

    def _create(self, slot: int):
        r = self.cfg.ray
        strategy: Any = "SPREAD"
        if self.placement_group is not None:
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=slot)
        actor_cls = self.actor_class.options(
            num_cpus=r.num_cpus_per_actor, num_gpus=r.num_gpus_per_actor, max_restarts=r.max_restarts,
            max_task_retries=0, scheduling_strategy=strategy, runtime_env=self.runtime_env,
        )
        return actor_cls.remote(client_ids=self.blocks[slot], **self.actor_args)

    def wait_ready(self) -> list[dict]:
        """Block until every actor is up; return their :meth:`ClientActor.describe`.

        Raises
        ------
        RfedrayError
            If an actor fails to start (its own error, e.g. a GPU that torch cannot use), or the
            cluster cannot host them all within ``ray.actor_start_timeout_s``.
        """
        try:
            return self.startup.gather([a.describe.remote() for a in self.actors], "client actors started")
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, RfedrayError):
                raise RfedrayError(f"a client actor failed to start: {exc.cause}") from None
            raise RfedrayError(f"a client actor failed to start: {_last_line(exc)}") from None
        except ray.exceptions.RayError as exc:
            raise RfedrayError(f"a client actor failed to start: {_last_line(exc)}") from None
        finally:
            self.startup.done()

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
        self.startup.done()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def _last_line(exc: BaseException) -> str:
    """The last line of a Ray error, which names the original error; an rfedray error's class name dropped."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    kind, sep, message = lines[-1].partition(": ")
    return message if sep and kind.startswith("rfedray.") else lines[-1]
