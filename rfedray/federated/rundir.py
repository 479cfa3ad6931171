"""The run directory: everything a run leaves behind, written so that a crash loses nothing.

Layout::

    RUN_DIR/config.yaml        resolved configuration
    RUN_DIR/budget.json        the privacy ledger, rewritten BEFORE every round trains (write-ahead)
    RUN_DIR/checkpoint.pt      theta, next round, optimiser states (every run.checkpoint_every rounds)
    RUN_DIR/metrics.jsonl      one line per completed round
    RUN_DIR/summary.json       the outcome (also written when a run halts or fails)
    RUN_DIR/model_final.pt     the final model

Every file but ``metrics.jsonl`` is replaced atomically (write a temporary file, fsync, rename), so a
crash while writing leaves the previous version usable.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from rfedray.errors import RfedrayError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


class RunDirectory:
    """Paths and safe writers of one run's directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @classmethod
    def create(cls, output_dir: str, run_id: str) -> "RunDirectory":
        root = Path(output_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
            path = root / run_id
            path.mkdir()
            probe = path / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise RfedrayError(
                f"run.output_dir={output_dir!r}: cannot create a run directory there ({exc.strerror}); "
                "choose a writable directory with run.output_dir=PATH"
            ) from None
        return cls(path)

    @property
    def run_id(self) -> str:
        return self.path.name

    config = property(lambda self: self.path / "config.yaml")
    budget = property(lambda self: self.path / "budget.json")
    checkpoint = property(lambda self: self.path / "checkpoint.pt")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    final_model = property(lambda self: self.path / "model_final.pt")

    def write_checkpoint(self, state: dict) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_bytes(self.checkpoint, buffer.getvalue())

    def read_checkpoint(self) -> dict:
        if not self.checkpoint.is_file():
            raise RfedrayError(f"--resume {self.path}: no checkpoint.pt there; the run cannot be resumed")
        try:
            state = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RfedrayError(
                f"--resume {self.path}: checkpoint.pt is unreadable ({type(exc).__name__}); "
                "it may be corrupt: restore it from a backup or start a new run"
            ) from None
        if not isinstance(state, dict) or "round" not in state or "theta" not in state:
            raise RfedrayError(f"--resume {self.path}: checkpoint.pt does not hold a rfedray checkpoint")
        return state

    def append_metrics(self, record: dict) -> None:
        with open(self.metrics, "a") as fh:
            fh.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_metrics(self) -> list[dict]:
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]

    def metrics_before(self, before_round: int) -> list[dict]:
        """The lines of ``metrics.jsonl`` a resume from ``before_round`` keeps (earlier rounds, events).

        A last line cut short (the process was killed while appending it) belongs to a round the
        resume redoes and is dropped; an unreadable line before it is an error.

        Raises
        ------
        RfedrayError
            Naming the unreadable line.
        """
        lines = self.metrics.read_text().splitlines() if self.metrics.is_file() else []
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
        atomic_write_bytes(self.metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept).encode())
