"""Console progress: a run's round line, and progress bars for long loops (studies, data loading).

A run shows one line redrawn in place on a terminal, one line per round otherwise (its own format:
epsilon against the target and the evaluation metrics matter more there than a bar). Loops over
many runs or subjects use :func:`bar`, a ``tqdm`` progress bar on a terminal.

Rounds are numbered from 0, as in the run directory's ``metrics.jsonl``; the display counts them from
1. On a TTY (and unless ``quiet``) the line is redrawn with a carriage return after every round::

    round 12/50 | eps 0.8421/1 (84%) | loss -3.215 gap 0.01234 | 1.23 s/round | ETA 0:00:47

When the stream is not a terminal (a log file, ``ray job logs``, CI) or ``quiet=True``, the same text
is written as a plain line per round, so logs stay readable and grep-able.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from collections import deque
from typing import Iterable, Mapping, Optional, TextIO, TypeVar

T = TypeVar("T")

import psutil

_ETA_WINDOW = 10

log = logging.getLogger(__name__)


def log_startup(phase: str) -> None:
    """Log, at debug level (``rfedray run --verbose``), that ``phase`` of the start-up is done, when,
    and this process's resident memory then.

    The time is the seconds since this process started, so the lines of a run add up to its
    start-up: ``start-up: Ray started at 6.21 s, 331 MiB resident``.
    """
    me = psutil.Process()
    log.debug("start-up: %s at %.2f s, %.0f MiB resident", phase, time.time() - me.create_time(),
              me.memory_info().rss / 2**20)


def _format_number(value: float) -> str:
    return f"{value:.4g}"


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def bar(items: Iterable[T], *, total: Optional[int] = None, desc: str = "", unit: str = "it",
        stream: Optional[TextIO] = None) -> Iterable[T]:
    """``items``, with a ``tqdm`` progress bar on ``stream`` (default stderr) when it is a terminal.

    Off a terminal (logs, CI) the items come back without a bar: callers that want a line in the
    log write it themselves.
    """
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(items, total=total, desc=desc, unit=unit, file=stream, disable=not _is_tty(stream), leave=False,
                dynamic_ncols=True)


class Progress:
    """Progress display of a run of ``total_rounds`` rounds.

    Parameters
    ----------
    total_rounds : int
        Rounds the run will do, >= 1.
    stream : text stream
        Where to write (default ``sys.stderr``, so stdout stays free for results).
    quiet : bool
        Write a plain line per round even on a terminal.
    epsilon_target : float or None
        Target epsilon, > 0, shown next to the epsilon spent; None for no target.

    Raises
    ------
    ValueError
        When a value is outside its allowed range; the message names the argument.
    """

    def __init__(
        self,
        total_rounds: int,
        *,
        stream: Optional[TextIO] = None,
        quiet: bool = False,
        epsilon_target: Optional[float] = None,
    ):
        if isinstance(total_rounds, bool) or not isinstance(total_rounds, int) or total_rounds < 1:
            raise ValueError(f"total_rounds={total_rounds!r}: must be an integer >= 1")
        if epsilon_target is not None and not (math.isfinite(epsilon_target) and epsilon_target > 0):
            raise ValueError(f"epsilon_target={epsilon_target!r}: must be None or a finite number > 0")
        self.total_rounds = total_rounds
        self.stream = sys.stderr if stream is None else stream
        self.epsilon_target = epsilon_target
        self.live = not quiet and _is_tty(self.stream)
        self._recent: deque[float] = deque(maxlen=_ETA_WINDOW)
        self._drawn = 0
        self._closed = False

    def format_line(
        self, round: int, epsilon_spent: Optional[float], metrics: Mapping[str, float], round_seconds: float
    ) -> str:
        """The progress text after round ``round`` (0-based; no newline, no carriage return)."""
        done = round + 1
        parts = [f"round {done}/{self.total_rounds}"]
        if epsilon_spent is None:
            parts.append("non-private")
        else:
            eps = f"eps {_format_number(epsilon_spent)}"
            if self.epsilon_target is not None:
                eps += f"/{_format_number(self.epsilon_target)} ({100 * epsilon_spent / self.epsilon_target:.0f}%)"
            parts.append(eps)
        if metrics:
            parts.append(" ".join(f"{key} {_format_number(value)}" for key, value in metrics.items()))
        parts.append(f"{round_seconds:.3g} s/round")
        if done < self.total_rounds and self._recent:
            mean = sum(self._recent) / len(self._recent)
            parts.append(f"ETA {_format_duration(mean * (self.total_rounds - done))}")
        return " | ".join(parts)

    def update(
        self, round: int, epsilon_spent: Optional[float], metrics: Mapping[str, float], round_seconds: float
    ) -> None:
        """Show the state after a completed round.

        Parameters
        ----------
        round : int
            Index of the round just completed, in [0, total_rounds - 1] (shown as ``round + 1``).
        epsilon_spent : float or None
            Epsilon spent so far, >= 0 (inf allowed); None for a non-private run.
        metrics : mapping of str to float
            Evaluation of the global model (e.g. ``loss``, ``accuracy``, ``gap``); may be empty.
        round_seconds : float
            Wall time of the round, finite and >= 0; the ETA averages the last few.

        Raises
        ------
        ValueError
            When a value is outside its allowed range, or after :meth:`close`.
        """
        if self._closed:
            raise ValueError("Progress.update: the progress display is closed")
        if isinstance(round, bool) or not isinstance(round, int) or not (0 <= round < self.total_rounds):
            raise ValueError(
                f"round={round!r}: must be a round index between 0 and total_rounds - 1 ({self.total_rounds - 1})"
            )
        if epsilon_spent is not None:
            epsilon_spent = float(epsilon_spent)
            if math.isnan(epsilon_spent) or epsilon_spent < 0:
                raise ValueError(f"epsilon_spent={epsilon_spent!r}: must be None or a number >= 0 (inf allowed)")
        round_seconds = float(round_seconds)
        if not (math.isfinite(round_seconds) and round_seconds >= 0):
            raise ValueError(f"round_seconds={round_seconds!r}: must be a finite number >= 0")
        values = {}
        for key, value in metrics.items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metrics[{key!r}]={value!r}: must be a number") from None
        self._recent.append(round_seconds)
        line = self.format_line(round, epsilon_spent, values, round_seconds)
        if self.live:
            width = max(shutil.get_terminal_size(fallback=(120, 24)).columns - 1, 20)
            line = line[:width]
            self.stream.write("\r" + line + " " * max(self._drawn - len(line), 0))
            self._drawn = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, final_message: Optional[str] = None) -> None:
        """End the display: finish the live line, then write ``final_message`` (if any) on its own line.

        Idempotent: a second call writes nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._drawn:
            self.stream.write("\n")
            self._drawn = 0
        if final_message:
            self.stream.write(final_message + "\n")
        self.stream.flush()
