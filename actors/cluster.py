"""What the Ray cluster can host for the client actors, and waiting while it grows.

Every client actor of a run asks for the same *bundle* of resources,
``{"CPU": ray.num_cpus_per_actor, "GPU": ray.num_gpus_per_actor}``. Clusters come in two kinds:

* **fixed** (a local instance, nodes started with ``ray start`` and no autoscaler): the live nodes
  are all there will ever be, so a request they cannot pack is refused at once;
* **autoscaling** (``ray up``, KubeRay, Ray's ``fake_multinode`` provider in the tests): nodes
  appear when work asks for them. The pool asks the autoscaler for the actors' bundles
  (:func:`ray.autoscaler.sdk.request_resources`) and waits for them up to
  ``ray.actor_start_timeout_s`` (a GPU node's boot and set-up take minutes), logging what it is
  waiting for. A request is refused at once only when no node type of the cluster could ever host
  it; the node types are those of the autoscaling configuration the head's autoscaler runs with
  (readable when rfedray runs on the head node, as ``ray job submit`` does), or those Ray's GCS
  publishes. When they cannot be read, the deadline is the only limit.

Ray counts fractional resources in units of 1/10000, so ``ray.num_gpus_per_actor=0.25`` packs four
actors on one GPU.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import ray
import yaml

from rfedray.config import Config, ConfigError
from rfedray.errors import RfedrayError

log = logging.getLogger(__name__)

Bundle = Mapping[str, float]

FIELDS = {"CPU": "ray.num_cpus_per_actor", "GPU": "ray.num_gpus_per_actor"}
"""The configuration field that sets each resource of a client actor's bundle."""

HEAD_RESOURCE = "node:__internal_head__"
PROGRESS_INTERVAL_S = 10.0
"""How often a wait for the cluster logs what it is waiting for."""

_UNIT = 1e-4  # Ray's resource granularity


def actor_bundle(cfg: Config) -> dict[str, float]:
    """The resources one client actor asks for (zero amounts left out)."""
    r = cfg.ray
    return {k: v for k, v in (("CPU", r.num_cpus_per_actor), ("GPU", r.num_gpus_per_actor)) if v > 0}


def bundles_on(resources: Mapping[str, float], bundle: Bundle) -> int:
    """How many copies of ``bundle`` one node with ``resources`` holds (``bundle`` not empty)."""
    return min(math.floor(resources.get(k, 0.0) / v + _UNIT) for k, v in bundle.items())


def describe_bundle(bundle: Bundle) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"


@dataclass(frozen=True)
class NodeType:
    """A kind of worker node the autoscaler can add: its resources and how many of it there may be."""

    name: str
    resources: Mapping[str, float]
    max_count: int


@dataclass(frozen=True)
class ClusterShape:
    """The live nodes of a Ray cluster and, when it autoscales, the worker node types it can add.

    Parameters
    ----------
    live : sequence of mapping
        Resources of every alive node (the head's include ``node:__internal_head__``).
    autoscaling : bool
        Whether an autoscaler adds nodes on demand.
    node_types : tuple of NodeType or None
        The worker node types of the autoscaler; None when they cannot be read (or on a fixed
        cluster).
    max_workers : int or None
        The autoscaler's cap on worker nodes of all types together (None: no cap known).
    pending : int
        Worker nodes the autoscaler is launching or setting up right now.
    """

    live: tuple[Mapping[str, float], ...]
    autoscaling: bool = False
    node_types: Optional[tuple[NodeType, ...]] = None
    max_workers: Optional[int] = None
    pending: int = 0

    @classmethod
    def fixed(cls, live: Sequence[Mapping[str, float]]) -> "ClusterShape":
        """A cluster of exactly these nodes."""
        return cls(tuple(live))

    @classmethod
    def discover(cls) -> "ClusterShape":
        """The shape of the cluster this process is connected to.

        An autoscaler is recognised by its report in the GCS (what ``ray status`` reads) or by the
        autoscaler-v2 flag; its node types come from the cluster configuration Ray's GCS holds, or
        else from the autoscaling configuration file its monitor process was started with, when
        that process runs on this node.
        """
        live = tuple(dict(n["Resources"]) for n in ray.nodes() if n["Alive"])
        report = _autoscaler_report()
        summary = report.get("autoscaler_report", {})
        if not (_launches_nodes(summary) or _autoscaler_v2()):
            return cls(live)
        pending = len(summary.get("pending_nodes", [])) + sum(summary.get("pending_launches", {}).values())
        node_types, max_workers = _node_types_from_gcs()
        if node_types is None:
            node_types, max_workers = _node_types_from_monitor(report.get("monitor_pid"))
        return cls(live, True, node_types, max_workers, pending)

    def _worker_counts(self, per_node: dict[str, int]) -> list[int]:
        """Bundles per node of the worker nodes the autoscaler could have at most, best first."""
        nodes = []
        for t in self.node_types or ():
            nodes += [per_node[t.name]] * max(0, t.max_count)
        nodes.sort(reverse=True)
        return nodes if self.max_workers is None else nodes[: self.max_workers]

    def most_bundles(self, bundle: Bundle, placement: str = "SPREAD") -> Optional[int]:
        """The most copies of ``bundle`` the cluster could ever host at once under ``placement``.

        None when that cannot be known (an autoscaler whose node types are unreadable) or when the
        bundle is empty (actors that ask for no resource fit anywhere).
        """
        if not bundle or (self.autoscaling and self.node_types is None):
            return None
        counts = [bundles_on(n, bundle) for n in self.live]
        if self.autoscaling:
            head = [bundles_on(n, bundle) for n in self.live if HEAD_RESOURCE in n]
            per_type = {t.name: bundles_on(t.resources, bundle) for t in self.node_types}
            grown = head + self._worker_counts(per_type)
            counts = max(counts, grown, key=lambda c: _combine(c, placement))
        return _combine(counts, placement)

    def largest(self, resource: str) -> float:
        """The most of ``resource`` one node has, or could have."""
        amounts = [n.get(resource, 0.0) for n in self.live]
        amounts += [t.resources.get(resource, 0.0) for t in self.node_types or () if t.max_count > 0]
        return max(amounts, default=0.0)

    def describe(self) -> str:
        """The nodes (and node types) in a few words, for error messages."""
        def res(r):
            return describe_bundle({k: v for k, v in r.items() if k in ("CPU", "GPU")})

        text = f"{len(self.live)} live node(s) " + ", ".join(res(n) for n in self.live)
        if self.autoscaling and self.node_types is not None:
            types = ", ".join(f"{t.name} {res(t.resources)} x {t.max_count}" for t in self.node_types)
            text += f"; worker node types {types or 'none'}"
            if self.max_workers is not None:
                text += f", at most {self.max_workers} worker node(s)"
        return text

    def check(self, cfg: Config, count: int) -> None:
        """Refuse ``count`` client actors that the cluster could never host at once.

        Raises
        ------
        ConfigError
            Naming the per-actor resource that no node (type) has enough of, or, when a few actors
            fit but not ``count``, the resource that runs out first.
        """
        bundle = actor_bundle(cfg)
        most = self.most_bundles(bundle, cfg.ray.placement)
        if most is None or most >= count:
            return
        where = "node type" if self.autoscaling else "node"
        too_big = [k for k, v in sorted(bundle.items()) if v > self.largest(k) + _UNIT]
        if most == 0 and too_big:
            k = too_big[-1]
            raise ConfigError(FIELDS[k], bundle[k], f"no {where} of the Ray cluster has {bundle[k]:g} {k} for one "
                              f"client actor (the largest has {self.largest(k):g}; {self.describe()})")
        scarce = min(sorted(bundle, reverse=True), key=lambda k: self.most_bundles({k: bundle[k]}, cfg.ray.placement))
        ever = "could ever host" if self.autoscaling else "has room for"
        raise ConfigError(
            FIELDS[scarce], bundle[scarce],
            f"{count} client actors of {describe_bundle(bundle)} each: the Ray cluster {ever} at most {most} "
            f"(ray.placement={cfg.ray.placement}; {self.describe()}); lower it or ray.num_client_actors",
        )


def _combine(counts: Sequence[int], placement: str) -> int:
    """Bundles a set of nodes holds under a placement strategy, from each node's count."""
    if placement == "STRICT_PACK":
        return max(counts, default=0)
    if placement == "STRICT_SPREAD":
        return sum(1 for c in counts if c > 0)
    return sum(counts)


def _autoscaler_report() -> dict:
    """The status the cluster's monitor last wrote to the GCS (``ray status`` reads it), or {}."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        return json.loads(raw) if raw else {}
    except (ValueError, RuntimeError, ConnectionError):
        return {}


def _launches_nodes(summary: Mapping) -> bool:
    """Whether a (v1) autoscaler report comes from an autoscaler that adds nodes.

    Every head runs one; without an autoscaling configuration (a local instance, ``ray start``
    nodes) it uses Ray's read-only provider, which only mirrors the live nodes, each as a node type
    ``node_<node id>``.
    """
    mapping = summary.get("node_type_mapping") or {}
    return bool(mapping) and any(kind != f"node_{node}" for node, kind in mapping.items())


def _autoscaler_v2() -> bool:
    """Whether the cluster runs Ray's autoscaler v2 (asked from the GCS, not a per-process cache)."""
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        return bool(is_autoscaler_v2(fetch_from_server=True))
    except Exception:  # an older or partial Ray: no v2 autoscaler
        return False


def _node_types_from_gcs() -> tuple[Optional[tuple[NodeType, ...]], Optional[int]]:
    """Worker node types from the cluster configuration the GCS holds, when one was reported."""
    from ray._private.state import state

    try:
        config = state.get_cluster_config()
    except Exception:
        config = None
    if config is None or not config.node_group_configs:
        return None, None
    types = tuple(NodeType(g.name, dict(g.resources), g.max_count if g.max_count >= 0 else 10**6)
                  for g in config.node_group_configs)
    return types, None


def _node_types_from_monitor(pid: Optional[int]) -> tuple[Optional[tuple[NodeType, ...]], Optional[int]]:
    """Worker node types from the autoscaling configuration of the monitor process ``pid`` on this node."""
    import psutil

    if not pid:
        return None, None
    try:
        argv = psutil.Process(int(pid)).cmdline()
    except (psutil.Error, ValueError):
        return None, None
    port = ray.get_runtime_context().gcs_address.rpartition(":")[2]
    if not any(a.startswith("--gcs-address=") and a.endswith(":" + port) for a in argv):
        return None, None  # another cluster's monitor, or not a monitor
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--autoscaling-config=")), None)
    if path is None and "--autoscaling-config" in argv[:-1]:
        path = argv[argv.index("--autoscaling-config") + 1]
    if not path:
        return None, None
    try:
        with open(os.path.expanduser(path)) as f:
            return node_types_from_config(yaml.safe_load(f))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        return None, None


def node_types_from_config(config: Mapping) -> tuple[tuple[NodeType, ...], Optional[int]]:
    """The worker node types and the worker cap of an autoscaling configuration (``ray up`` format).

    Raises
    ------
    KeyError, TypeError, ValueError
        For a configuration without ``available_node_types`` and ``head_node_type``.
    """
    head = config["head_node_type"]
    default_max = config.get("max_workers", 0)
    types = tuple(
        NodeType(name, dict(spec.get("resources") or {}), int(spec.get("max_workers", default_max)))
        for name, spec in config["available_node_types"].items() if name != head
    )
    cap = config.get("max_workers")
    return types, None if cap is None else int(cap)


class ClusterWait:
    """Waits for the client actors' resources until ``ray.actor_start_timeout_s``, saying what it waits for.

    On an autoscaling cluster it first asks the autoscaler for the bundles
    (:func:`ray.autoscaler.sdk.request_resources`); :meth:`done` withdraws that request, so that
    the nodes scale down when the run ends (the actors' own resources keep them up meanwhile, and
    a restarted actor's demand brings a lost node back).

    Parameters
    ----------
    cfg : Config
    count : int
        Client actors of the run.
    shape : ClusterShape
        The cluster as :meth:`ClusterShape.discover` saw it.
    """

    def __init__(self, cfg: Config, count: int, shape: ClusterShape):
        self.cfg, self.count, self.shape = cfg, count, shape
        self.bundle = actor_bundle(cfg)
        self.timeout_s = cfg.ray.actor_start_timeout_s
        self.started: Optional[float] = None  # the deadline runs from the first wait
        self.requested = shape.autoscaling and bool(self.bundle)
        if self.requested:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[dict(self.bundle)] * count)

    def remaining(self) -> float:
        """Seconds left before ``ray.actor_start_timeout_s`` (counted from the first wait)."""
        if self.started is None:
            self.started = time.monotonic()
        return self.started + self.timeout_s - time.monotonic()

    def progress(self, missing: int) -> str:
        """One line: how many of the actors' bundles are missing, and the nodes there are for them."""
        shape = ClusterShape.discover() if self.shape.autoscaling else self.shape
        starting = f", {shape.pending} starting" if shape.pending else ""
        waited = f"({self.timeout_s - self.remaining():.0f} s of ray.actor_start_timeout_s={self.timeout_s:g})"
        if not self.bundle:  # actors that ask for no resource: any node hosts them
            return (f"waiting for {missing} of {self.count} client actors to start: "
                    f"{len(shape.live)} node(s) up{starting} {waited}")
        if sum(bundles_on(n, self.bundle) for n in shape.live) >= self.count:  # placed: importing, building data
            return (f"waiting for {missing} of {self.count} client actors to start: the {len(shape.live)} node(s) up "
                    f"hold their bundles {describe_bundle(self.bundle)} {waited}")
        kind = "GPU" if "GPU" in self.bundle else "CPU"
        return (f"waiting for {missing} of {self.count} client actors' {kind} bundles {describe_bundle(self.bundle)}: "
                f"{sum(bundles_on(n, self.bundle) > 0 for n in shape.live)} node(s) for them up{starting} {waited}")

    def gather(self, refs: Sequence[ray.ObjectRef], what: str, bundles_per_ref: int = 1) -> list:
        """The values of ``refs``, waiting for them until the deadline and logging progress meanwhile.

        Parameters
        ----------
        refs : sequence of ObjectRef
            One per client actor (or one for a placement group).
        what : str
            What the refs stand for, for the timeout message ("client actors", "placement group").
        bundles_per_ref : int
            Actor bundles each ref waits for (a placement group's ref waits for all of them).

        Raises
        ------
        RfedrayError
            At the deadline, naming ``ray.actor_start_timeout_s`` and what was missing.
        ray.exceptions.RayError
            As soon as one of ``refs`` fails (an actor that cannot start).
        """
        values: dict[int, object] = {}
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        self.remaining()  # starts the clock
        next_note = time.monotonic() + PROGRESS_INTERVAL_S
        while pending:
            if self.remaining() <= 0:
                raise RfedrayError(
                    f"ray.actor_start_timeout_s={self.timeout_s:g}: {len(pending)} of {len(refs)} {what} not ready; "
                    f"{self.progress(len(pending) * bundles_per_ref)}. The cluster: "
                    f"{ClusterShape.discover().describe()}. Raise ray.actor_start_timeout_s for slow node boots, "
                    "or see `ray status`"
                )
            step = max(0.0, min(self.remaining(), next_note - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=step)
            for ref in ready:
                values[index[ref]] = ray.get(ref)
            if pending and time.monotonic() >= next_note:
                log.warning("%s", self.progress(len(pending) * bundles_per_ref))
                next_note = time.monotonic() + PROGRESS_INTERVAL_S
        return [values[i] for i in range(len(refs))]

    def done(self) -> None:
        """Withdraw the request for resources (idempotent)."""
        if self.requested:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
            self.requested = False
