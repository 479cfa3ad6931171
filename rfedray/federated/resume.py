"""Saving a run between rounds and resuming it: the checkpoint, the write-ahead ledger, their checks.

A run directory holds two records of a run's progress (:mod:`rfedray.federated.rundir`):

* ``checkpoint.pt``, at round 0 (before anything is charged) and every ``run.checkpoint_every``
  rounds: a :class:`RunState` (theta, the next round, the clients' optimiser states, the counters
  and the last metrics), the accounting fingerprint and a copy of the ledger (with its sequence
  number, the charges it covers);
* ``budget.json`` and ``ledger.jsonl``, written before every round trains
  (:mod:`rfedray.federated.budget`). They may be ahead of the checkpoint (rounds charged, then
  lost in a crash); a resume keeps them, so a resumed run never reports less than was spent, and
  redoes (and charges again) the rounds after the checkpoint. A ``budget.json`` that is missing or
  older than any other trace is refused.

A resume first checks, writing nothing, that the configuration can continue the run
(:meth:`Checkpoints.check`): the same accounting fingerprint, the same model shapes, a finite model,
``run.rounds`` not below the rounds done, a ``budget.json`` of the same fingerprint that no other
trace is ahead of, and a readable ``metrics.jsonl``. An engine that starts other processes checks before it starts them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from rfedray.config import Config, ConfigError
from rfedray.errors import RfedrayError
from rfedray.federated.budget import BudgetFiles
from rfedray.federated.rundir import RunDirectory, RunDirectoryWriteError
from rfedray.privacy.ledger import Authorization
from rfedray.privacy.plan import PrivacyPlan
from rfedray.task import Params

RESERVE_FACTOR = 3
RESERVE_EXTRA_BYTES = 64 * 1024
"""Space kept free in a local run directory: 3 times the checkpoint and the budget ledger (each
file and its temporary copy, with room to grow) and 64 KiB for the metrics line and the summary."""

FINGERPRINT_NOTES = {"data.client_sizes": "the clients' record counts differ"}
"""How a changed accounting setting is described when its value is not readable (a hash)."""


def accounting_fingerprint(cfg: Config, privacy: PrivacyPlan, sizes: list[int]) -> dict:
    """Everything the ledger's numbers depend on; a resume must not change any of it.

    Parameters
    ----------
    cfg : Config
    privacy : PrivacyPlan
        The run's resolved plan (its sigma, calibrated when the configuration left it null).
    sizes : list of int
        Every client's record count.
    """
    p = cfg.privacy
    return {
        "privacy": {"enabled": privacy.private, "sigma": privacy.sigma, "clip": p.clip, "delta": p.delta,
                    "accountant": p.accountant},
        "federation.local_steps": cfg.federation.local_steps,
        "federation.batch_size": cfg.federation.batch_size,
        "federation.n_clients": cfg.federation.n_clients,
        "data.client_sizes": hashlib.sha256(json.dumps(sizes).encode()).hexdigest(),
    }


def _flatten(fingerprint: Mapping) -> dict:
    """``{"privacy": {"clip": c}, ...}`` as ``{"privacy.clip": c, ...}``."""
    flat = {}
    for key, value in fingerprint.items():
        flat.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
    return flat


@dataclass
class RunState:
    """Where a run stands before a round: what a checkpoint keeps.

    Attributes
    ----------
    theta : dict of Tensor
        The global model theta_t.
    round : int
        t, the next round to run (rounds ``0 .. t-1`` are done).
    optimizer_states : dict
        Each client's optimiser state after its last participation, by client id.
    counters : dict
        ``client_failures`` and ``submissions_rejected`` so far.
    last_metrics : dict
        The last evaluation of the global model.
    """

    theta: Params
    round: int = 0
    optimizer_states: dict[int, dict] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {"client_failures": 0, "submissions_rejected": 0})
    last_metrics: dict[str, float] = field(default_factory=dict)


class Checkpoints:
    """The checkpoint and the write-ahead ledger of one run directory.

    Parameters
    ----------
    run_dir : RunDirectory
    fingerprint : dict
        The run's :func:`accounting_fingerprint`.
    rounds : int
        ``run.rounds``, the rounds the run is configured for.
    initial : dict of Tensor
        The run's starting model theta_0: gives the shapes a checkpoint's model must have.
    """

    def __init__(self, run_dir: RunDirectory, fingerprint: dict, rounds: int, initial: Params):
        self.run_dir, self.fingerprint, self.rounds, self.initial = run_dir, fingerprint, rounds, initial
        self.shapes = {k: tuple(v.shape) for k, v in initial.items()}

    def start(self, ledger) -> RunState:
        """A new run: the ledger's files (its empty ledger, :meth:`WriteAheadLedger.start`) and the
        checkpoint of round 0 (theta_0), before anything is charged, so that a run stopped at any
        point, even in its first round, can be resumed."""
        state = RunState(self.initial)
        self.save(state, ledger.start())
        return state

    def save(self, state: RunState, ledger: Optional[dict]) -> None:
        """Write ``checkpoint.pt`` for ``state`` (after round ``state.round - 1``) with ``ledger``,
        the ledger's state after that round's charge (None when not private), then keep room
        (``.reserve``, :meth:`_room`) for the next one: a write that finds the disk full gives that
        space back, the loop checkpoints at the end of the round, and the run stops here.

        Raises
        ------
        RunDirectoryWriteError
            When the checkpoint cannot be written, or the disk is full (after this checkpoint).
        """
        rd = self.run_dir
        size = rd.write_checkpoint({
            "round": state.round, "theta": {k: v.detach().cpu() for k, v in state.theta.items()},
            "optimizer_states": state.optimizer_states, "counters": dict(state.counters),
            "fingerprint": self.fingerprint, "ledger": ledger, "last_metrics": dict(state.last_metrics),
        })
        if state.round < self.rounds and (rd.out_of_space() or not rd.reserve(self._room(size))):
            raise RunDirectoryWriteError(
                f"the file system of {rd.path} is full: the run stopped after round {state.round} with its checkpoint "
                f"written; free space and continue with rfedray run --resume {rd.path}"
            )

    def _room(self, checkpoint_bytes: int) -> int:
        """Bytes to keep free (``.reserve``) for the rest of a round and the next checkpoint."""
        rd = self.run_dir
        budget_bytes = rd.size("budget.json") if rd.is_file("budget.json") else 0
        return RESERVE_FACTOR * (checkpoint_bytes + budget_bytes) + RESERVE_EXTRA_BYTES

    def _check_checkpoint(self, state: dict) -> None:
        """Refuse a checkpoint that this configuration cannot continue (nothing is written before).

        Raises
        ------
        ConfigError
            When a setting the accounting depends on changed, or ``run.rounds`` is below the
            rounds already completed.
        RfedrayError
            When the checkpoint's model does not fit the configured model or is not finite.
        """
        rd = self.run_dir
        damaged = "it is damaged, and rfedray cannot continue a run without its checkpoint: start a new run"
        before, now = _flatten(state.get("fingerprint") or {}), _flatten(self.fingerprint)
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if changed:
            details = "; ".join(
                f"{k}: {FINGERPRINT_NOTES[k]}" if k in FINGERPRINT_NOTES else f"{k} was {before.get(k)!r}, now {now.get(k)!r}"
                for k in changed
            )
            raise ConfigError(
                changed[0], "changed since the checkpoint",
                f"a resumed run must keep every setting the privacy accounting depends on ({details}); "
                "resume with the original values, or start a new run",
            )
        done = state["round"]
        if isinstance(done, bool) or not isinstance(done, int) or done < 0:
            raise RfedrayError(f"--resume {rd.path}: checkpoint.pt records round {done!r}, not a round count; {damaged}")
        if done > self.rounds:
            raise ConfigError("run.rounds", self.rounds,
                              f"the run has already completed {done} rounds; resume with run.rounds >= {done}")
        theta = state["theta"]
        found = ({k: tuple(v.shape) for k, v in theta.items() if isinstance(v, torch.Tensor)}
                 if isinstance(theta, dict) else None)
        if found != self.shapes:
            raise RfedrayError(
                f"--resume {rd.path}: checkpoint.pt holds a model of shapes {found}, the configuration builds "
                f"{self.shapes}; resume with the configuration the run was started with (its config.yaml)"
            )
        if not all(bool(torch.isfinite(v).all()) for v in theta.values()):
            raise RfedrayError(f"--resume {rd.path}: checkpoint.pt holds a model that is not finite; {damaged}")

    def _load_ledger(self, ledger, state: dict) -> None:
        """Load the spent budget into ``ledger``: ``budget.json``, once every other trace agrees it is
        the newest (:meth:`~rfedray.federated.budget.BudgetFiles.trusted`; see the module docstring).

        Raises
        ------
        RfedrayError
            When ``budget.json`` is missing, older than the checkpoint, the charge log or the
            rounds of ``metrics.jsonl``, or does not fit this run.
        """
        if ledger.state_dict() is None:
            return  # a run without privacy keeps no ledger
        rd = self.run_dir
        saved = BudgetFiles(rd, self.fingerprint).trusted(state, rd.read_metrics(tolerant=True))
        try:
            ledger.load_state_dict(saved)
        except (RfedrayError, KeyError, TypeError, AttributeError) as exc:
            raise RfedrayError(
                f"--resume {rd.path}: budget.json's ledger does not fit this run ({type(exc).__name__}: {exc}); resume "
                "with the configuration the run was started with (its config.yaml)"
            ) from None

    def check(self, ledger) -> RunState:
        """Check, writing nothing, that the run directory can be resumed; its checkpoint's state.

        Parameters
        ----------
        ledger : PrivacyLedger, NullLedger or a remote ledger
            The run's ledger: the saved budget is loaded into it.

        Raises
        ------
        RfedrayError
            (or its :class:`ConfigError`) naming the file or the setting, and what to do.
        """
        state = self.run_dir.read_checkpoint()
        self._check_checkpoint(state)
        self._load_ledger(ledger, state)
        self.run_dir.metrics_before(state["round"])
        return RunState(state["theta"], state["round"], state["optimizer_states"], state["counters"],
                        state.get("last_metrics", {}))

    def resume(self, ledger) -> RunState:
        """:meth:`check`, then keep room for checkpoints, drop the rounds after the checkpoint from
        ``metrics.jsonl`` and log the resume with the ledger's sequence number.

        Raises
        ------
        RunDirectoryWriteError
            When the disk has not the room for the run's next checkpoints (nothing written).
        """
        rd = self.run_dir
        state = self.check(ledger)
        room = self._room(rd.size("checkpoint.pt"))
        if not rd.reserve(room):
            raise RunDirectoryWriteError(
                f"the file system of {rd.path} has not {room} bytes free for the run's next checkpoints; "
                f"nothing was written: free space and continue with rfedray run --resume {rd.path}"
            )
        rd.truncate_metrics(state.round)
        saved = ledger.state_dict()
        rd.append_metrics({"event": "resumed", "round": state.round, "epsilon_spent": ledger.epsilon_spent(),
                           "ledger_charges": saved["charges"] if saved is not None else None})
        return state


class WriteAheadLedger:
    """A ledger whose every granted charge is on disk before :meth:`authorize` returns.

    The only writer of the run's ledger files (:class:`~rfedray.federated.budget.BudgetFiles`:
    ``budget.json`` and the hash-chained charge log ``ledger.jsonl``): the loop's on the local
    engine, the accountant actor's on Ray (:mod:`actors.accountant_actor`, which Ray restarts: a
    restarted one reloads ``budget.json``). It loads ``budget.json`` when the file was written for
    the same accounting fingerprint, and writes under the run directory's lock token, so a writer
    that outlives its driver cannot write once a resume took the run directory over.

    A grant is fenced: after the charge is persisted, :meth:`authorize` checks the writer token
    again (:meth:`~rfedray.federated.rundir.RunDirectory.check_writer`) and refuses (raises, the
    cohort does not train) when the run directory was taken over meanwhile. With the order a resume
    follows (take the lock, announce its token in ``.lock``, only then read ``budget.json``), every
    granted charge is seen by every later resume: a grant's fence read ``.lock`` before the resume's
    announcement, its ``budget.json`` write was finished before that read, and the resume reads
    ``budget.json`` after announcing, so it reads that write (both stores give read-after-write: a
    rename on a local folder, a finished PUT in object storage). A charge whose fence fails may be
    counted or lost by the resume, but its cohort never trains: over-counting is possible,
    under-counting is not. The same holds for a request answered again without charging.

    Every charge may carry a request id: a caller that re-sends a request it could not see answered
    (Ray re-sends a call in flight when the actor died) gets the earlier answer, charged once.

    Parameters
    ----------
    ledger : PrivacyLedger or NullLedger
        A fresh ledger of the run (its own copy); a NullLedger writes nothing.
    fingerprint : dict
        What the accounting depends on (:func:`accounting_fingerprint`), written with the ledger.
    run_dir : RunDirectory
        The run directory (with the writer token of its lock).
    """

    def __init__(self, ledger, fingerprint: dict, run_dir: RunDirectory):
        self._ledger, self._files = ledger, BudgetFiles(run_dir, fingerprint)
        self._last: Optional[dict] = None
        saved = self._files.current()
        if saved is not None:
            self._files.check_head(saved)
            self._ledger.load_state_dict(saved["ledger"])
            self._last = saved.get("request")

    def start(self) -> Optional[dict[str, Any]]:
        """Write a new run's ledger files (the empty ledger, the first line of the charge log); return
        the empty ledger's state (what the checkpoint of round 0 keeps; None when not private)."""
        state = self._ledger.state_dict()
        if state is not None:
            self._files.start(state)
        return state

    def authorize(self, cohort: Sequence[int], count: int = 1, round: Optional[int] = None,
                  request: Optional[str] = None) -> Authorization:
        """Charge the cohort (:meth:`PrivacyLedger.authorize`) and persist the charge before returning.

        Parameters
        ----------
        cohort : sequence of int
        count : int
            Participations each client releases in the round.
        round : int or None
            The round being charged, recorded with the ledger.
        request : str or None
            Unique per round; a repeated request is answered without charging again.

        Raises
        ------
        RunDirectoryWriteError
            When the charge cannot be persisted, or another process took the run directory over
            (the cohort must not train then; see the class docstring).
        """
        if request is not None and self._last is not None and self._last["id"] == request:
            self._files.run_dir.check_writer()  # the fence: a replayed grant is a grant too
            return Authorization(self._last["granted"], self._last["reason"], self._last["epsilon_after"],
                                 self._ledger.state_dict())
        auth = self._ledger.authorize(cohort, count)
        if auth.granted and auth.state is not None:
            last = None if request is None else {"id": request, "granted": True, "reason": auth.reason,
                                                  "epsilon_after": auth.epsilon_after}
            self._files.commit(auth.state, round, cohort, count, auth.epsilon_after,
                               None if last is None else {"request": last})
            # The fence: the charge is persisted; if a resume took the run directory over since the
            # commit checked the writer, it may have read budget.json before this charge: refuse.
            self._files.run_dir.check_writer()
            if last is not None:
                self._last = last
        return auth

    def epsilon_spent(self) -> Optional[float]:
        return self._ledger.epsilon_spent()

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self._ledger.state_dict()

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        self._ledger.load_state_dict(state)
