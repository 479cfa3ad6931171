"""The Ray executor: a cohort's local training on the client actors, within the round deadline.

A round: theta_t is put in the object store once; each client actor with clients in the cohort gets
one call; the executor waits for the answers until ``ray.round_timeout_s``. A call to an actor that
Ray is restarting, or that is still busy with an earlier round, waits for it within that deadline.
An actor that dies during its call, a call that fails and a missed deadline make the actor's
clients dropouts of the round (:class:`~rfedray.federated.client.ClientFailure`). Ray restarts
killed actors (``ray.max_restarts``); the executor re-creates the ones that died for good, and the
cluster schedules them when it has room again.

:func:`ray_executor` also serves a federation run in the calling process (tests, benchmarks).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Optional, Sequence

import ray

from actors.accountant_actor import RemoteLedger, start_accountant
from actors.client_actor import ACTOR_START_TIMEOUT_S, ClientPool, assign_clients, check_capacity
from actors.session import RaySession, check_ray_config
from rfedray.errors import RfedrayError
from rfedray.federated.client import ClientFailure, LocalResult
from rfedray.federated.loop import Federation
from rfedray.federated.resume import accounting_fingerprint
from rfedray.federated.setup import local_plan
from rfedray.task import Params
from rfedray.threads import choose_threads

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.25
"""Pause between probes of a client actor that Ray is restarting."""

LATE = {
    "call": "no answer",
    "probe": "its client actor was still restarting",
    "earlier": "its client actor was still busy with an earlier round",
}
"""Why a client actor's clients are dropouts at the deadline, by what its slot was waiting on."""


class RayExecutor:
    """Runs a cohort's local training on the client actors (implements the core's Executor).

    Parameters
    ----------
    session : RaySession
    timeout_s : float
        The round deadline, ``ray.round_timeout_s``.
    """

    def __init__(self, session: RaySession, timeout_s: float):
        self.session, self.timeout_s = session, timeout_s
        self.pool: Optional[ClientPool] = None
        self.accountant = None
        self._inflight: dict[int, ray.ObjectRef] = {}
        self._dead: set[int] = set()
        self._restarting: set[int] = set()

    def start(self, fed: Federation) -> list[dict]:
        """Start the client actors and, for a private run, the accountant; wait until they are up.

        Returns
        -------
        list of dict
            Every client actor's :meth:`~actors.client_actor.ClientActor.describe`.
        """
        cfg = fed.cfg
        resources = ray.cluster_resources()
        blocks = assign_clients(cfg.federation.n_clients, cfg, resources.get("CPU", 0.0))
        check_capacity(cfg, len(blocks), resources)
        threads = choose_threads(cfg.federation.batch_size, fed.dataset.info["record_shape"],
                                 max(1, int(cfg.ray.num_cpus_per_actor)), cfg.run.threads)
        self.pool = ClientPool(cfg, local_plan(cfg, fed.privacy), blocks, threads)
        if fed.privacy.private:  # a run without privacy keeps its null ledger in the server
            fingerprint = accounting_fingerprint(cfg, fed.privacy, fed.sizes)
            self.accountant = start_accountant(fed.make_ledger(), fingerprint, fed.run_dir.budget)
            try:
                ray.get(self.accountant.epsilon_spent.remote(), timeout=ACTOR_START_TIMEOUT_S)
            except ray.exceptions.RayError as exc:
                raise RfedrayError(f"the privacy accountant actor did not start ({type(exc).__name__}): "
                                   f"{str(exc).strip().splitlines()[-1]}") from None
            fed.ledger_factory = lambda: RemoteLedger(self.accountant)
        return self.pool.wait_ready()

    def describe(self) -> list[dict]:
        """Every client actor's :meth:`~actors.client_actor.ClientActor.describe` (waits for it)."""
        return ray.get([a.describe.remote() for a in self.pool.actors])

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

    def _next_step(self, slot: int, call_args: tuple) -> tuple[ray.ObjectRef, str]:
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
        self._inflight[slot] = self.pool.actors[slot].train.remote(*call_args)
        return self._inflight[slot], "call"

    def train(
        self, cohort: Sequence[int], theta: Params, round_index: int, states: Mapping[int, dict]
    ) -> dict[int, LocalResult | ClientFailure]:
        """Local training of ``cohort`` on the actors hosting it, within the round deadline.

        Each actor gets one call. It waits, within the deadline, for the actor to be ready: for
        its call of an earlier round to end, for Ray to restart it, or for a re-created actor to
        start. A call that fails (the actor died while training, or the call errored) and a call
        without answer at the deadline make the actor's clients dropouts of the round.
        """
        theta_ref = ray.put(theta)
        groups = self.pool.group(cohort)
        deadline = time.monotonic() + self.timeout_s
        answers: dict[int, dict | str] = {}
        waiting: dict[ray.ObjectRef, tuple[int, str]] = {}

        def advance(slot: int) -> None:
            members = groups[slot]
            ref, kind = self._next_step(slot, (members, theta_ref, round_index, {c: states.get(c) for c in members}))
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
        results: dict[int, LocalResult | ClientFailure] = {}
        for slot, members in sorted(groups.items()):
            answer = answers[slot] if slot in answers else late[slot]
            if isinstance(answer, str):
                log.warning("round %d: clients %s are dropouts: %s (client actor %d)", round_index, members, answer, slot)
                results.update({cid: ClientFailure(answer) for cid in members})
            else:
                missing = ClientFailure("the client actor returned no result for it")
                results.update({cid: answer.get(cid, missing) for cid in members})
        return results

    def close(self) -> None:
        """Stop the actors; shut Ray down if this run started it."""
        if self.pool is not None:
            self.pool.close()
        if self.accountant is not None:
            ray.kill(self.accountant, no_restart=True)
        self.session.close()


def ray_executor(fed: Federation) -> RayExecutor:
    """The Ray executor of ``fed``: Ray connected or started, actors up, accountant attached to ``fed``.

    Raises
    ------
    RfedrayError
        When Ray cannot be reached or the actors cannot start (the message names the setting).
    """
    check_ray_config(fed.cfg)
    executor = RayExecutor(RaySession.open(fed.cfg.ray.address), fed.cfg.ray.round_timeout_s)
    try:
        executor.start(fed)
    except BaseException:
        executor.close()
        raise
    return executor
