"""The Ray engines: a cohort's work on the client actors, within the round deadline.

A round: theta_t is put in the object store once; each client actor with clients in the cohort gets
one call; the engine waits for the answers until the round deadline (``ray.round_timeout_s``). A
call to an actor that Ray is restarting, or that is still busy with an earlier round, waits for it
within that deadline. An actor that dies during its call, a call that fails and a missed deadline
make the actor's clients dropouts of the round (:class:`~rfedray.federated.client.ClientFailure`).
Ray restarts killed actors (``ray.max_restarts``); the engine re-creates the ones that died for
good, and the cluster schedules them when it has room again. :class:`ActorCalls` does this for both
engines:

* :class:`RayExecutor` (:func:`ray_executor`): DP-RFedProj's local training on
  :class:`~actors.client_actor.ClientActor` s; it also serves a federation run in the calling
  process (tests, benchmarks).
* :class:`ActorEngine` itself (:func:`ray_task_engine`): the client tasks of M-estimation and DDP-SA
  (:mod:`rfedray.federated.engine`) on :class:`~actors.client_actor.TaskHostActor` s; its
  :meth:`ActorEngine.run` is also the Ray executor's evaluation on the clients' test splits.

On one machine (a Ray instance this process started, :attr:`~actors.session.RaySession.one_machine`)
the privacy ledger stays with the loop, in this process: the loop's own
:class:`~rfedray.federated.resume.WriteAheadLedger`, the one the accountant actor is on a cluster
(single writer of ``budget.json`` and ``ledger.jsonl``, write-ahead, under the run directory's lock
token): no accountant actor. Every client's records stay in the client actors on either layout:
this process is the server's, which never holds a client's records (the threat model).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import ray

from actors.accountant_actor import RemoteLedger, start_accountant
from actors.aggregators import RayAggregators
from actors.client_actor import ClientPool, RemoteClientActor, RemoteTaskHostActor, assign_clients
from actors.cluster import ClusterShape
from actors.session import RaySession, check_ray_config, user_code_env
from rfedray.config import Config, RayConfig
from rfedray.errors import RfedrayError
from rfedray.federated.client import ClientFailure, LocalResult
from rfedray.federated.engine import ClientTask, TaskSpec
from rfedray.federated.evaluation import NUM_AGGREGATORS
from rfedray.federated.loop import Federation
from rfedray.federated.resume import accounting_fingerprint
from rfedray.federated.setup import local_plan
from rfedray.federated.wire import to_arrays
from rfedray.progress import log_startup
from rfedray.task import Params

log = logging.getLogger(__name__)

ACCOUNTANT_START_TIMEOUT_S = 120.0
"""How long the driver waits for the accountant actor (on its own node, no resources) to start."""

PROBE_INTERVAL_S = 0.25
"""Pause between probes of a client actor that Ray is restarting."""

LATE = {
    "call": "no answer",
    "probe": "its client actor was still restarting",
    "earlier": "its client actor was still busy with an earlier round",
}
"""Why a client actor's clients are dropouts at the deadline, by what its slot was waiting on."""


class ActorCalls:
    """One call per client actor of a cohort, answered within the round deadline through restarts.

    Parameters
    ----------
    pool : ClientPool
        The actors and the clients each hosts.
    timeout_s : float
        The round deadline.
    """

    def __init__(self, pool: ClientPool, timeout_s: float):
        self.pool, self.timeout_s = pool, timeout_s
        self._inflight: dict[int, ray.ObjectRef] = {}
        self._dead: set[int] = set()
        self._restarting: set[int] = set()

    def _outcome(self, slot: int, ref: ray.ObjectRef) -> dict | str:
        """The answer of a finished call or probe, or why there is none; notes the actor's state."""
        try:
            answer = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            self._restarting.discard(slot)
            self._dead.add(slot)
            return "its client actor died"
        except ray.exceptions.ActorUnavailableError:
            self._restarting.add(slot)
            return "its client actor is unavailable (restarting)"
        except ray.exceptions.RayError as exc:
            return f"the call failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1]})"
        self._restarting.discard(slot)
        return answer

    def _next_step(self, slot: int, call: Callable[[], ray.ObjectRef]) -> tuple[ray.ObjectRef, str]:
        """What ``slot`` waits on now: its earlier round's call, a probe of its restart, or this round's call."""
        earlier = self._inflight.get(slot)
        if earlier is not None:
            if not ray.wait([earlier], timeout=0)[0]:
                return earlier, "earlier"
            self._outcome(slot, self._inflight.pop(slot))
        if slot in self._dead:
            log.warning("client actor %d died for good: re-creating it for clients %s", slot, self.pool.blocks[slot])
            self.pool.recreate(slot)
            self._dead.discard(slot)
        if slot in self._restarting:
            return self.pool.actors[slot].describe.remote(), "probe"
        self._inflight[slot] = call()
        return self._inflight[slot], "call"

    def run(self, cohort: Sequence[int], call: Callable[[Any, list[int]], ray.ObjectRef],
            round_index: int) -> dict[int, Any]:
        """``call(actor, members)`` on every actor hosting clients of ``cohort``; each client's answer.

        Each actor gets one call. It waits, within the deadline, for the actor to be ready: for
        its call of an earlier round to end, for Ray to restart it, or for a re-created actor to
        start. A call that fails (the actor died during it, or the call errored) and a call
        without answer at the deadline make the actor's clients dropouts of the round.

        Returns
        -------
        dict
            Per client of ``cohort``, by actor, what the call answered for it or a ClientFailure.
        """
        groups = self.pool.group(cohort)
        deadline = time.monotonic() + self.timeout_s
        answers: dict[int, dict | str] = {}
        waiting: dict[ray.ObjectRef, tuple[int, str]] = {}

        def advance(slot: int) -> None:
            members = groups[slot]
            ref, kind = self._next_step(slot, lambda: call(self.pool.actors[slot], members))
            waiting[ref] = (slot, kind)

        for slot in groups:
            advance(slot)
        while waiting and (remaining := deadline - time.monotonic()) > 0:
            for ref in ray.wait(list(waiting), num_returns=1, timeout=remaining)[0]:
                slot, kind = waiting.pop(ref)
                if kind == "call":
                    answers[slot] = self._outcome(slot, self._inflight.pop(slot))
                    continue
                if kind == "probe" and isinstance(self._outcome(slot, ref), str) and slot in self._restarting:
                    time.sleep(min(PROBE_INTERVAL_S, max(0.0, deadline - time.monotonic())))
                advance(slot)
        late = {slot: f"{LATE[kind]} at ray.round_timeout_s={self.timeout_s:g}" for slot, kind in waiting.values()}
        results: dict[int, Any] = {}
        for slot, members in sorted(groups.items()):
            answer = answers[slot] if slot in answers else late[slot]
            if isinstance(answer, str):
                log.warning("round %d: clients %s are dropouts: %s (client actor %d)", round_index, members, answer, slot)
                results.update({cid: ClientFailure(answer) for cid in members})
            else:
                missing = ClientFailure("the client actor returned no result for it")
                results.update({cid: answer.get(cid, missing) for cid in members})
        return results


class ActorEngine:
    """A Ray engine: this process's Ray session, and a pool of client actors whose calls
    :class:`ActorCalls` runs within the round deadline; it runs client tasks on them.

    Parameters
    ----------
    session : RaySession
    timeout_s : float
        The round deadline.
    """

    def __init__(self, session: RaySession, timeout_s: float):
        self.session, self.timeout_s = session, timeout_s
        self.pool: Optional[ClientPool] = None
        self.calls: Optional[ActorCalls] = None

    def start_pool(self, cfg: Config, n_clients: int, actor_class, actor_args: dict,
                   runtime_env: Optional[dict] = None) -> None:
        """Client actors of ``actor_class`` for ``n_clients`` clients in sticky blocks
        (:func:`~actors.client_actor.assign_clients`), refused at once when the cluster could never
        host them (:meth:`~actors.cluster.ClusterShape.check`)."""
        shape = ClusterShape.discover()
        blocks = assign_clients(n_clients, cfg.ray, ray.cluster_resources().get("CPU", 0.0))
        shape.check(cfg, len(blocks))
        self.pool = ClientPool(cfg, blocks, shape, actor_class, actor_args, runtime_env)
        self.calls = ActorCalls(self.pool, self.timeout_s)

    def run(self, cohort: Sequence[int], task: ClientTask, theta: Params, round_index: int) -> dict[int, Any]:
        """``task`` on every client of ``cohort``, on the actors hosting them, within the round deadline
        (:meth:`ActorCalls.run`; implements :class:`rfedray.federated.engine.Engine`).

        Answers every client of the cohort in cohort order, as the local engine does, so that a loop
        combining the answers in that order computes the same bits on both engines.
        """
        theta_ref, task_ref = ray.put(theta), ray.put(task)

        def run(actor, members: list[int]) -> ray.ObjectRef:
            return actor.run.remote(members, task_ref, theta_ref, round_index)

        answers = self.calls.run(cohort, run, round_index)
        return {cid: answers[cid] for cid in cohort}

    def close(self) -> None:
        """Stop the actors; shut Ray down if this engine started it."""
        if self.pool is not None:
            self.pool.close()
        self.session.close()


class RayExecutor(ActorEngine):
    """Runs a cohort's local training on the client actors (implements the core's Executor).

    On :attr:`~actors.session.RaySession.one_machine` the ledger stays in this process (see the
    module docstring).
    """

    def __init__(self, session: RaySession, timeout_s: float):
        super().__init__(session, timeout_s)
        self.accountant = None
        self.aggregators: Optional[RayAggregators] = None

    def start(self, fed: Federation, runtime_env: Optional[dict]) -> None:
        """Start the client actors (``runtime_env``: :func:`~actors.session.user_code_env`) and, for a
        private run off one machine, the accountant; wait until they are up."""
        cfg = fed.cfg
        threads = fed.threads(cpus=max(1, int(cfg.ray.num_cpus_per_actor)))
        args = {"cfg": cfg, "plan": local_plan(cfg, fed.privacy), "threads": threads, "given": fed.given}
        self.start_pool(cfg, cfg.federation.n_clients, RemoteClientActor, args, runtime_env)
        if fed.privacy.private and not self.session.one_machine:  # else the loop's own WriteAheadLedger, here
            fingerprint = accounting_fingerprint(cfg, fed.privacy, fed.sizes)
            self.accountant = start_accountant(fed.make_ledger(), fingerprint, fed.run_dir)
            try:
                ray.get(self.accountant.epsilon_spent.remote(), timeout=ACCOUNTANT_START_TIMEOUT_S)
            except ray.exceptions.RayError as exc:
                raise RfedrayError(f"the privacy accountant actor did not start ({type(exc).__name__}): "
                                   f"{str(exc).strip().splitlines()[-1]}") from None
            fed.ledger_factory = lambda: RemoteLedger(self.accountant)
        self.pool.wait_ready()
        log_startup("client actors up")

    def describe(self) -> list[dict]:
        """Every client actor's :meth:`~actors.client_actor.ClientActor.describe` (waits for it)."""
        return ray.get([a.describe.remote() for a in self.pool.actors])

    def train(
        self, cohort: Sequence[int], theta: Params, round_index: int, states: Mapping[int, dict]
    ) -> dict[int, LocalResult | ClientFailure]:
        """Local training of ``cohort`` on the actors hosting it, within the round deadline
        (:meth:`ActorCalls.run`)."""
        theta_ref = ray.put(to_arrays(theta))  # tensors as numpy arrays (rfedray.federated.wire)

        def train(actor, members: list[int]) -> ray.ObjectRef:
            return actor.train.remote(members, theta_ref, round_index, {c: to_arrays(states.get(c)) for c in members})

        return self.calls.run(cohort, train, round_index)

    def share_aggregators(self) -> RayAggregators:
        """The evaluation's aggregator actors (started on first use, stopped by :meth:`close`)."""
        if self.aggregators is None:
            self.aggregators = RayAggregators(NUM_AGGREGATORS)
        return self.aggregators

    def close(self) -> None:
        """Stop the actors; shut Ray down if this run started it."""
        if self.aggregators is not None:
            self.aggregators.close()
        if self.accountant is not None:
            ray.kill(self.accountant, no_restart=True)
        super().close()


def ray_executor(fed: Federation, runtime_env: Optional[dict] = None, session: Optional[RaySession] = None) -> RayExecutor:
    """The Ray executor of ``fed``: Ray connected or started, actors up, accountant attached to ``fed``.

    Parameters
    ----------
    fed : Federation
    runtime_env : dict, optional
        Of the client actors; by default :func:`~actors.session.user_code_env` of ``fed``.
    session : RaySession, optional
        This process's connection to Ray when it has one; opened from ``ray.address`` when None.

    Raises
    ------
    RfedrayError
        When Ray cannot be reached or the actors cannot start (the message names the setting).
    """
    check_ray_config(fed.cfg)
    executor = RayExecutor(session or RaySession.open(fed.cfg.ray.address), fed.cfg.ray.round_timeout_s)
    try:
        if runtime_env is None:
            runtime_env = user_code_env(fed.cfg, fed.given.objects() if fed.given is not None else ())
        executor.start(fed, runtime_env)
    except BaseException:
        executor.close()
        raise
    return executor


def ray_task_engine(spec: TaskSpec, n_clients: int, num_hosts: int,
                    timeout_s: float = RayConfig.round_timeout_s) -> ActorEngine:
    """A Ray engine of ``num_hosts`` task-host actors (one CPU and one torch thread each) over
    ``n_clients`` clients built from ``spec``; Ray connected (``RAY_ADDRESS``) or started.

    Raises
    ------
    RfedrayError
        When Ray cannot be reached or the actors cannot start.
    """
    engine = ActorEngine(RaySession.open(None), timeout_s)
    try:
        hosts = Config(ray=RayConfig(num_client_actors=min(num_hosts, n_clients), num_cpus_per_actor=1.0,
                                     device="cpu", round_timeout_s=timeout_s))
        engine.start_pool(hosts, n_clients, RemoteTaskHostActor, {"spec": spec, "threads": 1})
        engine.pool.wait_ready()
    except BaseException:
        engine.close()
        raise
    return engine
