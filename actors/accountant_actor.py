"""The privacy accountant of a Ray run: one actor that holds every client's budget.

The actor is a :class:`~rfedray.federated.resume.WriteAheadLedger`: its
:meth:`~rfedray.federated.resume.WriteAheadLedger.authorize` charges a round's cohort before any
client trains and writes the ledger to the run directory's ``budget.json`` and its charge log
``ledger.jsonl`` before it returns (write-ahead; the actor is their only writer, under the driver's
lock token); it refuses, charging nothing, when a client would pass the target epsilon (the loop
then halts the run). The actor runs on the driver's node, and Ray restarts it whenever it dies; a
restarted actor reloads ``budget.json``, so a restart never forgets spent budget.

Every charge carries a request id: Ray re-sends a call that was in flight when the actor died, and
the restarted actor answers a request it had already persisted without charging it twice.

:class:`RemoteLedger` is what the federation loop holds instead of a local ledger. A round costs
it one call: the authorization carries the epsilon after the charge and the ledger's state.
"""

from __future__ import annotations

import uuid
from typing import Any, Mapping, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rfedray.errors import RfedrayError
from rfedray.federated.resume import WriteAheadLedger
from rfedray.federated.rundir import RunDirectory
from rfedray.privacy.ledger import Authorization, PrivacyLedger


class AccountantActor(WriteAheadLedger):
    """The run's :class:`WriteAheadLedger`, as the Ray actor its processes are named after
    (``ray::AccountantActor``).

    It prepares its ledger when it starts (:meth:`~rfedray.privacy.ledger.PrivacyLedger.prepare`), so
    that the first round's charge does not wait for the accountant's imports and first PLD
    (``benchmarks/bench_accounting_round.py``: round 0's call took 0.5 s of a 30-round run's 0.8 s).
    """

    def __init__(self, ledger, fingerprint: dict, run_dir: RunDirectory):
        super().__init__(ledger, fingerprint, run_dir)
        self._ledger.prepare()


def start_accountant(ledger: PrivacyLedger, fingerprint: dict, run_dir: RunDirectory):
    """The accountant actor (a :class:`WriteAheadLedger` of ``ledger``), pinned to this (the
    driver's) node and restarted whenever it dies."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(AccountantActor).options(
        num_cpus=0, max_restarts=-1, max_task_retries=-1, scheduling_strategy=here,
    )
    return actor_cls.remote(ledger, fingerprint, run_dir)


class RemoteLedger:
    """The ledger interface the federation loop uses, answered by the accountant actor.

    Parameters
    ----------
    actor : ray.actor.ActorHandle
        An :class:`AccountantActor` (:func:`start_accountant`).
    """

    def __init__(self, actor):
        self.actor = actor

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from None
        except ray.exceptions.RayActorError as exc:
            raise RfedrayError(
                f"the privacy accountant actor is gone ({type(exc).__name__}); budget.json in the run "
                "directory keeps every charge: continue with rfedray run --resume RUN_DIR"
            ) from None

    def authorize(self, cohort: Sequence[int], count: int = 1, round: Optional[int] = None) -> Authorization:
        """Charge and persist in one call (a unique request id makes a re-sent call harmless)."""
        return self._call("authorize", [int(c) for c in cohort], count, round, uuid.uuid4().hex)

    def start(self) -> Optional[dict[str, Any]]:
        """Write a new run's ledger files (the actor is their only writer); the empty ledger's state."""
        return self._call("start")

    def epsilon_spent(self) -> Optional[float]:
        return self._call("epsilon_spent")

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self._call("state_dict")

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        self._call("load_state_dict", None if state is None else dict(state))
