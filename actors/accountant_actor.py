"""The privacy accountant of a Ray run: one actor that holds every client's budget.

:class:`AccountantActor` wraps the run's :class:`~rfedray.privacy.ledger.PrivacyLedger`. Its
:meth:`~AccountantActor.authorize` charges a round's cohort before any client trains and writes the
ledger to the run directory's ``budget.json`` before it returns (write-ahead); it refuses, charging
nothing, when a client would pass the target epsilon (the loop then halts the run). The actor runs
on the driver's node, where the run directory is, and Ray restarts it whenever it dies; a restarted
actor reloads ``budget.json``, so a restart never forgets spent budget.

Every charge carries a request id: Ray re-sends a call that was in flight when the actor died, and
the restarted actor answers a request it had already persisted without charging it twice.

:class:`RemoteLedger` is what the federation loop holds instead of a local ledger.
"""

from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rfedray.errors import RfedrayError
from rfedray.federated.budget import BudgetFiles
from rfedray.federated.rundir import RunDirectory
from rfedray.privacy.ledger import Authorization, PrivacyLedger


@contextmanager
def user_errors_as_rfedray_errors() -> Iterator[None]:
    """Re-raise rfedray's user errors as plain :class:`RfedrayError` with the same message and exit status.

    Ray pickles an actor's exception to the caller, and the subclasses (``ConfigError``,
    ``PrivacyParameterError``) do not unpickle (their constructors take three arguments).
    """
    try:
        yield
    except RfedrayError as exc:
        plain = RfedrayError(str(exc))
        plain.exit_code = exc.exit_code
        raise plain from None


class AccountantActor:
    """Every client's privacy budget, persisted before each round trains.

    Parameters
    ----------
    ledger : PrivacyLedger
        A fresh ledger for the run's mechanism (the actor's own copy).
    fingerprint : dict
        What the accounting depends on (see :func:`rfedray.federated.resume.accounting_fingerprint`);
        written with the ledger, and a ``budget.json`` with another one is not loaded.
    run_dir : str
        The run directory (its ``budget.json`` is the ledger's file).
    writer_token : str
        The token of the driver's lock on the run directory: the actor writes under it.
    """

    def __init__(self, ledger: PrivacyLedger, fingerprint: dict, run_dir: str, writer_token: str):
        self._ledger = ledger
        self._files = BudgetFiles(RunDirectory(run_dir, writer_token), fingerprint)
        self._last: Optional[dict] = None
        if self._files.run_dir.is_file("budget.json"):
            saved = json.loads(self._files.run_dir.read_bytes("budget.json"))
            if saved.get("fingerprint") == fingerprint:
                self._ledger.load_state_dict(saved["ledger"])
                self._last = saved.get("request")

    def authorize(self, cohort: Sequence[int], round_index: Optional[int], request: str) -> Authorization:
        """Charge the cohort (see :meth:`PrivacyLedger.authorize`) and persist before returning.

        Parameters
        ----------
        cohort : sequence of int
        round_index : int or None
            The round the charge is for (written to the charge log).
        request : str
            Unique per round; a repeated request is answered without charging again.
        """
        if self._last is not None and self._last["id"] == request:
            return Authorization(self._last["granted"], self._last["reason"], self._last["epsilon_after"])
        with user_errors_as_rfedray_errors():
            auth = self._ledger.authorize(cohort)
        if auth.granted:
            self._last = {"id": request, "granted": True, "reason": auth.reason, "epsilon_after": auth.epsilon_after}
            self._files.commit(self._ledger.state_dict(), round_index, cohort, auth.epsilon_after, {"request": self._last})
        return auth

    def epsilon_spent(self) -> float:
        return self._ledger.epsilon_spent()

    def state_dict(self) -> dict[str, Any]:
        return self._ledger.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with user_errors_as_rfedray_errors():
            self._ledger.load_state_dict(state)


def start_accountant(ledger: PrivacyLedger, fingerprint: dict, run_dir: RunDirectory):
    """The accountant actor, pinned to this (the driver's) node and restarted whenever it dies."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(AccountantActor).options(
        num_cpus=0, max_restarts=-1, max_task_retries=-1, scheduling_strategy=here,
    )
    return actor_cls.remote(ledger, fingerprint, str(run_dir.path), run_dir.writer_token)


class RemoteLedger:
    """The :class:`PrivacyLedger` interface the federation loop uses, answered by the actor.

    Parameters
    ----------
    actor : ray.actor.ActorHandle
        An :class:`AccountantActor`.
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

    def authorize(self, cohort: Sequence[int], round_index: Optional[int] = None) -> Authorization:
        return self._call("authorize", [int(c) for c in cohort], round_index, uuid.uuid4().hex)

    def epsilon_spent(self) -> float:
        return self._call("epsilon_spent")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._call("load_state_dict", dict(state))
