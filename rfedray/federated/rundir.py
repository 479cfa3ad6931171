"""The run directory: everything a run leaves behind, written so that a crash loses nothing.

Layout::

    RUN_DIR/config.yaml        resolved configuration
    RUN_DIR/budget.json        the privacy ledger, rewritten BEFORE every round trains (write-ahead)
    RUN_DIR/checkpoint.pt      theta, next round, optimiser states (round 0, then every
                               run.checkpoint_every rounds)
    RUN_DIR/metrics.jsonl      one line per completed round
    RUN_DIR/summary.json       the outcome (also written when a run halts or fails)
    RUN_DIR/model_final.pt     the final model
    RUN_DIR/ledger.jsonl       the charge log (see :mod:`rfedray.federated.budget`)
    RUN_DIR/.lock              who writes the run directory now (see :meth:`RunDirectory.lock`)
    RUN_DIR/.reserve           space kept free for the last checkpoint (see :meth:`RunDirectory.reserve`)

``RUN_DIR`` is a folder of this machine or an object-storage URL (:mod:`rfedray.federated.storage`).
Every file but the ``.jsonl`` logs is replaced atomically, so a crash while writing leaves the
previous version usable; a log line is appended whole or not at all. A write that fails (disk full,
permission, read-only file system) leaves the previous version in place and raises
:class:`RunDirectoryWriteError` (exit status 1): the run stops and ``--resume`` continues it.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import torch

from rfedray.errors import RfedrayError
from rfedray.federated.storage import (
    RunDirectoryWriteError, RunLock, Store, describe_holder, local_path, open_store,
)


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _name(file: str | os.PathLike) -> str:
    """A file of the run directory by name (callers may pass its full path or URL)."""
    return PurePosixPath(os.fspath(file)).name


class RunDirectory:
    """The files of one run and their safe writers, in a local folder or in object storage.

    Parameters
    ----------
    path : str or PathLike
        A folder, a ``file://`` URL, or an object-storage URL (``s3://bucket/runs/ID``).
    writer_token : str
        The lock token this process writes under (see :meth:`lock`); ``""`` writes without
        checking (a process that took no lock: tests, studies).
    """

    def __init__(self, path: str | os.PathLike, writer_token: str = ""):
        self.store: Store = open_store(path)
        self.path = self.store.location
        self.writer_token = writer_token

    def __reduce__(self):
        # Sent to another process (a Ray actor) as its location and writer token.
        return (type(self), (str(self.path), self.writer_token))

    @classmethod
    def create(cls, output_dir: str, run_id: str) -> "RunDirectory":
        """A new, empty run directory ``run_id`` in ``output_dir`` (a folder or an object-storage URL).

        Raises
        ------
        RfedrayError
            When nothing can be written there.
        """
        folder = local_path(output_dir)
        location = f"{output_dir.rstrip('/')}/{run_id}" if folder is None else folder / run_id
        try:
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                Path(location).mkdir()
            run_dir = cls(location)
            run_dir.store.write_atomic(".write-test", b"ok")
            run_dir.store.remove_all() if folder is None else (Path(location) / ".write-test").unlink()
        except (OSError, RfedrayError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise RfedrayError(
                f"run.output_dir={output_dir!r}: cannot create a run directory there ({reason}); "
                "choose a writable directory with run.output_dir=PATH"
            ) from None
        return run_dir

    @property
    def run_id(self) -> str:
        return _name(self.path)

    config = property(lambda self: self.store.where("config.yaml"))
    budget = property(lambda self: self.store.where("budget.json"))
    checkpoint = property(lambda self: self.store.where("checkpoint.pt"))
    metrics = property(lambda self: self.store.where("metrics.jsonl"))
    summary = property(lambda self: self.store.where("summary.json"))
    final_model = property(lambda self: self.store.where("model_final.pt"))

    # ----- reading -----------------------------------------------------------------------------

    def read_bytes(self, file: str | os.PathLike) -> bytes:
        return self.store.read_bytes(_name(file))

    def read_text(self, file: str | os.PathLike) -> str:
        return self.read_bytes(file).decode("utf-8", errors="replace")

    def exists(self, file: str | os.PathLike) -> bool:
        return self.store.exists(_name(file))

    def is_file(self, file: str | os.PathLike) -> bool:
        return self.store.is_file(_name(file))

    def size(self, file: str | os.PathLike) -> int:
        return self.store.size(_name(file))

    # ----- one writer ----------------------------------------------------------------------------

    def lock(self) -> RunLock:
        """Take the run directory's lock, or refuse naming its holder (host, pid, start time).

        Held by the driver for the whole run (a ``flock`` on a folder, a lock object with a
        heartbeat in object storage). :meth:`announce` records the holder and its token in
        ``.lock`` before the first write.

        Raises
        ------
        RunDirectoryBusyError
        """
        return self.store.lock()

    def announce(self, lock: RunLock, command: str) -> None:
        """Record ``lock``'s holder in ``.lock``; this object then writes under its token."""
        self.writer_token = lock.announce(command)

    def check_writer(self) -> None:
        """Refuse to write when another process took the run directory over since this one started.

        Every writer of a run (the driver, the Ray server and accountant actors) calls it first, so
        a process that outlives the driver it was started for cannot write once a resume took over.
        The check and the write that follows are two steps: a takeover can come between them, so a
        write that passed the check may land after a resume announced its token. Where that matters
        (a grant of the write-ahead ledger, :class:`~rfedray.federated.resume.WriteAheadLedger`),
        the writer checks again after the write, before acting on it (a fence); a resume announces
        its token (:meth:`announce`) before it reads anything it continues from.

        Raises
        ------
        RunDirectoryWriteError
            Naming the process that holds the run directory now.
        """
        if not self.writer_token:
            return
        holder = self.store.lock_record()
        if holder.get("token") != self.writer_token:
            raise RunDirectoryWriteError(
                f"{self.path}: another process took this run directory over ({describe_holder(holder)}); "
                "this one stops without writing"
            )

    # ----- space for the last checkpoint ---------------------------------------------------------

    def reserve(self, nbytes: int) -> bool:
        """Keep ``nbytes`` allocated in ``.reserve``, to be given back when the disk fills up.

        A write that finds the disk full frees this space and retries (:meth:`write_bytes`), so
        the round in progress and its checkpoint can still be written: the run then stops at a
        checkpoint and loses no trained round (see :meth:`out_of_space`). Object storage keeps
        no reserve.

        Returns
        -------
        bool
            False when the disk has not that much free space (no reserve is left then).

        Raises
        ------
        RunDirectoryWriteError
            When the reserve cannot be written for another reason (permission, read-only).
        """
        self.check_writer()
        return self.store.reserve(nbytes)

    def out_of_space(self) -> bool:
        """Whether a write had to use the reserved space: the run must checkpoint and stop."""
        return self.store.out_of_space()

    def drop_reserve(self) -> None:
        """Give the reserved space back (the run has finished)."""
        self.store.drop_reserve()

    # ----- writing -----------------------------------------------------------------------------

    def _write(self, write: Callable[[], None]) -> None:
        """``write()`` as the lock holder; a full disk gives back the reserve and ``write()`` is tried once more.

        Raises
        ------
        RunDirectoryWriteError
        """
        self.check_writer()
        try:
            write()
        except RunDirectoryWriteError as exc:
            if not (exc.out_of_space and self.store.release_reserve()):
                raise
            write()

    def write_bytes(self, file: str | os.PathLike, data: bytes) -> None:
        """Replace a file atomically (see :meth:`_write`).

        Raises
        ------
        RunDirectoryWriteError
        """
        self._write(lambda: self.store.write_atomic(_name(file), data))

    def write_json(self, file: str | os.PathLike, obj: Any) -> None:
        self.write_bytes(file, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())

    def append_line(self, file: str | os.PathLike, line: bytes) -> None:
        """Append ``line`` (persisted before returning); a failed append leaves the file as it was.

        Raises
        ------
        RunDirectoryWriteError
        """
        self._write(lambda: self.store.append(_name(file), line))

    def remove_all(self) -> None:
        """Delete the run directory (a run refused before its first checkpoint leaves nothing)."""
        self.store.remove_all()

    # ----- checkpoint, model, metrics ----------------------------------------------------------

    def write_checkpoint(self, state: dict) -> int:
        """Write ``checkpoint.pt``; return its size in bytes."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.write_bytes("checkpoint.pt", buffer.getvalue())
        return len(buffer.getvalue())

    def write_model(self, theta: dict) -> None:
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in theta.items()}, buffer)
        self.write_bytes("model_final.pt", buffer.getvalue())

    def read_checkpoint(self) -> dict:
        if not self.is_file("checkpoint.pt"):
            raise RfedrayError(f"--resume {self.path}: no checkpoint.pt there; the run cannot be resumed")
        try:
            state = torch.load(io.BytesIO(self.read_bytes("checkpoint.pt")), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RfedrayError(
                f"--resume {self.path}: checkpoint.pt is unreadable ({type(exc).__name__}); it is damaged, and "
                "rfedray cannot continue a run without its checkpoint: start a new run"
            ) from None
        if not isinstance(state, dict) or "round" not in state or "theta" not in state:
            raise RfedrayError(f"--resume {self.path}: checkpoint.pt does not hold a rfedray checkpoint")
        return state

    def append_metrics(self, record: dict) -> None:
        """Append one line to ``metrics.jsonl``; a failed append leaves the file as it was."""
        self.append_line("metrics.jsonl", (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode())

    def _metrics_lines(self) -> list[str]:
        return self.read_text("metrics.jsonl").splitlines() if self.is_file("metrics.jsonl") else []

    def read_metrics(self, tolerant: bool = False) -> list[dict]:
        """Every line of ``metrics.jsonl``; ``tolerant`` skips lines that are not JSON objects."""
        records = []
        for line in self._metrics_lines():
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                if not tolerant:
                    raise
                record = None
            if isinstance(record, dict):
                records.append(record)
        return records

    def metrics_before(self, before_round: int) -> list[dict]:
        """The lines of ``metrics.jsonl`` a resume from ``before_round`` keeps (earlier rounds, events).

        A last line cut short (the process was killed while appending it) belongs to a round the
        resume redoes and is dropped; an unreadable line before it is an error.

        Raises
        ------
        RfedrayError
            Naming the unreadable line.
        """
        lines = self._metrics_lines()
        records = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                if number < len(lines):
                    raise RfedrayError(
                        f"--resume {self.path}: metrics.jsonl line {number} is not JSON; repair or remove that "
                        "line (it is the run's round log) and resume again"
                    ) from None
        return [r for r in records if r.get("round", -1) < before_round or "event" in r]

    def truncate_metrics(self, before_round: int) -> None:
        """Keep the rounds before ``before_round`` (a resume redoes the later ones); see :meth:`metrics_before`."""
        kept = self.metrics_before(before_round)
        self.write_bytes("metrics.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept).encode())
