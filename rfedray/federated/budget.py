"""The run's privacy ledger on disk: written before every release, and never allowed to go back.

Two files hold it, both written before the cohort trains (write-ahead), by one writer, the run's
:class:`~rfedray.federated.resume.WriteAheadLedger`:

* ``budget.json``: the whole ledger (every client's participations) and its sequence number
  ``charges``, the number of cohorts charged so far, which only grows (a resumed run that redoes
  rounds charges them again);
* ``ledger.jsonl``: one line per charge (``charge``, ``round``, ``cohort``, ``count``, ``epsilon_after``),
  appended and fsynced, each line carrying the SHA-256 of the line before it (a hash chain).

The sequence number is mirrored where a run leaves other traces: the checkpoint holds the ledger it
was taken with, and every line of ``metrics.jsonl`` (rounds, and the ``resumed`` events) says
``ledger_charges``. :meth:`BudgetFiles.trusted` is what a resume loads: ``budget.json``, refused
(one line, exit status 2) when it is missing, not a file, unreadable, written for another
accounting set-up, or older than any of that evidence.

What this detects, and what it cannot:

* detected: ``budget.json`` deleted, replaced by a directory, or put back from an older copy (the
  charge log, the checkpoint or the metrics are ahead of it); an older ``budget.json`` *and* an
  older ``checkpoint.pt`` put back with ``metrics.jsonl`` cut short (``ledger.jsonl`` is still
  ahead); ``ledger.jsonl`` cut short or edited (its last line is behind ``budget.json``, or the
  chain breaks); ``budget.json`` replaced by one with as many charges but another history (its
  ``head`` is not the charge log's last line): what a writer that passed its check before a resume
  took over leaves when its write lands after the new writer's (a stalled process), which would
  otherwise swap the new writer's charge for the fenced one's;
* tolerated: a line written twice (the same bytes as an earlier line). The old writer of that race
  may append its line after the new writer has appended it from ``budget.json``; a copy carries no
  charge of its own, and the chain goes on from the first;
* not detectable: every one of ``budget.json``, ``ledger.jsonl``, ``checkpoint.pt`` and
  ``metrics.jsonl`` put back together to one consistent earlier state (a whole run directory
  restored from a backup) looks like a run that stopped there. Evidence outside the run directory
  (the Prometheus series of ``rfedray_epsilon_spent``, a versioned or object-locked bucket for
  ``run.output_dir``) is what shows it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Optional, Sequence

from rfedray.errors import RfedrayError
from rfedray.federated.rundir import RunDirectory

LOG_NAME = "ledger.jsonl"


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def _json_line(obj: dict) -> bytes:
    """One line of JSON, keys sorted: a line of the charge log, and ``budget.json``.

    ``budget.json`` is written before every round trains, with each client's size and participations
    in it: indented JSON goes through the json module's Python encoder, 14.5 ms a round at 10,000
    clients against 4.3 ms on one line (its C encoder).
    """
    return (json.dumps(obj, sort_keys=True, allow_nan=False) + "\n").encode()


class BudgetFiles:
    """``budget.json`` and ``ledger.jsonl`` of one run directory, for one accounting set-up.

    Parameters
    ----------
    run_dir : RunDirectory
    fingerprint : dict
        What the accounting depends on (:func:`rfedray.federated.resume.accounting_fingerprint`).
    """

    def __init__(self, run_dir: RunDirectory, fingerprint: dict):
        self.run_dir, self.fingerprint = run_dir, fingerprint
        self._head: Optional[str] = None  # the digest of the charge log's last line, once known

    # ----- writing ------------------------------------------------------------------------------

    def start(self, ledger_state: dict) -> None:
        """A new run's files: the empty ledger and a charge log that starts with the run's identity."""
        rd = self.run_dir
        rd.write_bytes("budget.json", _json_line({"fingerprint": self.fingerprint, "ledger": ledger_state, "round": None,
                                                  "head": ""}))
        header = _json_line({"charge": 0, "run_id": rd.run_id, "fingerprint": self.fingerprint, "prev": ""})
        rd.write_bytes(LOG_NAME, header)
        self._head = _digest(header)

    def commit(self, ledger_state: dict, round_index: Optional[int], cohort: Sequence[int], count: int,
               epsilon_after: float, extra: Optional[dict] = None) -> None:
        """Persist a charge before its cohort trains: ``budget.json`` first, then the charge log's line.

        A crash between the two leaves the log one line behind ``budget.json``; the next commit
        (after a resume, or a restart of the accountant actor) appends that line first, from
        ``budget.json``'s ``last``.

        Parameters
        ----------
        ledger_state : dict
            The ledger's state after the charge (its ``charges`` is this charge's number).
        round_index : int or None
        cohort : sequence of int
        count : int
            Participations charged to each client of ``cohort``.
        epsilon_after : float
        extra : dict, optional
            More keys for ``budget.json`` (the accountant actor's last request).

        Raises
        ------
        RunDirectoryWriteError
        """
        rd = self.run_dir
        if self._head is None:
            self.complete_log()
            self._head = self._last_line_digest()
        entry = {"charge": ledger_state["charges"], "round": round_index, "cohort": [int(c) for c in cohort],
                 "count": int(count), "epsilon_after": epsilon_after, "prev": self._head}
        line = _json_line(entry)
        self._head = None  # unknown until the line is in the log
        rd.write_bytes("budget.json", _json_line({"fingerprint": self.fingerprint, "ledger": ledger_state,
                                                  "round": round_index, "head": _digest(line), "last": entry,
                                                  **(extra or {})}))
        rd.append_line(LOG_NAME, line)
        self._head = _digest(line)

    def _last_line_digest(self) -> str:
        lines = self._log_lines()
        return _digest(lines[-1]) if lines else ""

    def _log_lines(self) -> list[bytes]:
        """The charge log's lines, each once: a line with the bytes of an earlier one is left out."""
        try:
            lines = [line + b"\n" for line in self.run_dir.read_bytes(LOG_NAME).splitlines() if line.strip()]
        except FileNotFoundError:
            return []
        return list(dict.fromkeys(lines))

    # ----- reading: what a resume may trust -----------------------------------------------------

    def _refuse(self, problem: str) -> RfedrayError:
        return RfedrayError(
            f"--resume {self.run_dir.path}: {problem}; resuming could report less epsilon than this run has "
            "released, so rfedray will not continue it"
        )

    def current(self) -> Optional[dict]:
        """``budget.json`` when it was written for this accounting set-up (None when absent or not).

        What a writer starting up loads (the accountant actor after a restart); a resume checks it
        first with :meth:`trusted`.

        Raises
        ------
        RfedrayError
            When it is there but not a file or unreadable: a writer must never start from an empty
            ledger over a spent budget.
        """
        rd = self.run_dir
        if not rd.exists("budget.json"):
            return None
        if not rd.is_file("budget.json"):
            raise self._refuse("budget.json is not a file (it must be the ledger of the budget this run has spent)")
        try:
            saved = json.loads(rd.read_bytes("budget.json"))
        except (OSError, ValueError) as exc:
            raise self._refuse(f"budget.json is unreadable ({type(exc).__name__}; it is the ledger of the budget spent)") from None
        fits = isinstance(saved, dict) and saved.get("fingerprint") == self.fingerprint and isinstance(saved.get("ledger"), dict)
        return saved if fits else None

    def saved(self) -> dict:
        """``budget.json`` as written for this accounting set-up.

        Raises
        ------
        RfedrayError
            When it is missing, not a file, unreadable or written for another set-up.
        """
        rd = self.run_dir
        if not rd.exists("budget.json"):
            raise self._refuse("budget.json is missing (it is the ledger of the budget this run has spent)")
        saved = self.current()
        if saved is None:
            raise RfedrayError(
                f"--resume {rd.path}: budget.json was not written for this run's accounting set-up (its fingerprint "
                "differs from the checkpoint's); resume with the configuration the run was started with (its config.yaml)"
            )
        return saved

    def _chain(self) -> list[dict]:
        """The charge log's entries, checked link by link.

        Raises
        ------
        RfedrayError
            When a line is not JSON or does not link to the line before it.
        """
        entries, prev = [], ""
        lines = self._log_lines()
        for number, line in enumerate(lines, start=1):
            try:
                entry = json.loads(line)
            except ValueError:
                if number == len(lines):
                    break  # cut short by a crash while appending: budget.json holds that charge
                raise self._refuse(f"{LOG_NAME} line {number} is not JSON (the charge log was altered)") from None
            if not isinstance(entry, dict) or entry.get("prev") != prev or not isinstance(entry.get("charge"), int):
                raise self._refuse(f"{LOG_NAME} line {number} does not follow the line before it (the charge log was altered)")
            entries.append(entry)
            prev = _digest(line)
        return entries

    def trusted(self, checkpoint: dict, metrics: Iterable[dict]) -> dict:
        """The ledger state a resume loads: ``budget.json``'s, after checking it against every other trace.

        Parameters
        ----------
        checkpoint : dict
            The checkpoint being resumed (its ``ledger`` holds the charges it was taken at).
        metrics : iterable of dict
            Every line of ``metrics.jsonl`` (their ``ledger_charges``).

        Raises
        ------
        RfedrayError
            (exit status 2) When ``budget.json`` is missing, unreadable, or older than the charge
            log, the checkpoint or the rounds of ``metrics.jsonl``. Writes nothing (a charge log
            one line behind after a crash is completed by :meth:`complete_log`).
        """
        saved = self.saved()
        charges = saved["ledger"].get("charges", 0)
        evidence = {f"the checkpoint (round {checkpoint.get('round')})": (checkpoint.get("ledger") or {}).get("charges", 0)}
        reported = [r["ledger_charges"] for r in metrics if isinstance(r.get("ledger_charges"), int)]
        if reported:
            evidence["metrics.jsonl"] = max(reported)
        chain = self._chain()
        if chain:
            evidence[LOG_NAME] = chain[-1]["charge"]
        behind = {where: n for where, n in evidence.items() if n > charges}
        if behind:
            where, n = max(behind.items(), key=lambda item: item[1])
            raise self._refuse(f"budget.json records {charges} charges but {where} shows {n}: budget.json is older "
                               "than what this run released")
        if chain and chain[-1]["charge"] < charges and self._missing_line(saved) is None:
            raise self._refuse(f"{LOG_NAME} ends at charge {chain[-1]['charge']} but budget.json records {charges} "
                               "(the charge log was cut short)")
        self.check_head(saved)
        return saved["ledger"]

    def check_head(self, saved: dict) -> None:
        """Refuse a ``budget.json`` whose history is not the charge log's.

        After its first charge, ``budget.json`` names the digest of the charge log's line for its
        last charge (``head``): that line is the log's last, or the one line a crash kept from it
        (:meth:`complete_log`). Anything else is a ``budget.json`` written by a writer that lost the
        run directory after its check and wrote after the new writer did: it has as many charges as
        the log and another cohort in the last, and loading it would forget a granted charge.
        What a resume checks (:meth:`trusted`), and a writer starting up (the accountant actor
        restarted by Ray) before it loads the ledger.

        Raises
        ------
        RfedrayError
        """
        if "head" not in saved or not saved["ledger"].get("charges", 0):
            return  # no charge yet (the head of a new run is "")
        if saved["head"] != self._last_line_digest() and self._missing_line(saved) is None:
            raise self._refuse(f"budget.json's last charge is not the last line of {LOG_NAME} (budget.json was "
                               "overwritten by a writer that had lost the run directory, or one of the two was edited)")

    def _missing_line(self, saved: dict) -> Optional[bytes]:
        """The charge log's line that a crash kept from being appended after ``budget.json`` (or None)."""
        last = saved.get("last")
        if not isinstance(last, dict) or last.get("prev") != self._last_line_digest():
            return None
        line = _json_line(last)
        return line if _digest(line) == saved.get("head") else None

    def complete_log(self) -> None:
        """Append the line of ``budget.json``'s last charge when a crash kept it from the charge log."""
        saved = self.current()
        line = None if saved is None else self._missing_line(saved)
        if line is not None and self._chain() and self._chain()[-1]["charge"] == saved["ledger"].get("charges", 0) - 1:
            self.run_dir.append_line(LOG_NAME, line)
