"""Argument checks shared by the mechanism, the accountants and the ledger.

Every check raises :class:`PrivacyParameterError` (a ``ValueError``) whose message names the
argument, the value and what is allowed, e.g. ``epsilon=-1: must be > 0``. The command line turns
the same error into ``error: --epsilon=-1: must be > 0`` using :attr:`PrivacyParameterError.name`
and :attr:`PrivacyParameterError.allowed`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from rfedray.errors import ConfigError


class PrivacyParameterError(ConfigError):
    """A privacy parameter outside its allowed range: ``PrivacyParameterError(name, value, allowed)``,
    e.g. ``("epsilon", -1, "must be > 0")`` (a :class:`~rfedray.errors.ConfigError` whose field is
    the argument's :attr:`name`)."""

    @property
    def name(self) -> str:
        """The argument, e.g. ``"epsilon"``."""
        return self.field


def real_number(name: str, value: Any) -> float:
    """``value`` as a float, checked to be a real number (not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise PrivacyParameterError(name, value, "must be a real number")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if type(value) is int:  # the common case, without the slower ABC checks (every local step samples)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and float(value).is_integer():
            return int(value)
        raise PrivacyParameterError(name, value, "must be an integer")
    return int(value)


def positive(name: str, value: Any) -> float:
    """``value`` as a float, checked finite and > 0."""
    v = real_number(name, value)
    PrivacyParameterError.check(v > 0 and math.isfinite(v), name, value,
                                "must be > 0" if math.isfinite(v) else "must be finite and > 0")
    return v


def open_unit(name: str, value: Any) -> float:
    """``value`` as a float, checked in the open interval (0, 1) (e.g. delta)."""
    v = real_number(name, value)
    PrivacyParameterError.check(0.0 < v < 1.0, name, value, "must be in (0, 1)")
    return v


def sampling_rate(name: str, value: Any) -> float:
    """``value`` as a float, checked in the half-open interval (0, 1] (a sampling rate ``q``)."""
    v = real_number(name, value)
    PrivacyParameterError.check(0.0 < v <= 1.0, name, value, "must be in (0, 1]")
    return v


def nonnegative_int(name: str, value: Any) -> int:
    """``value`` as an int, checked >= 0 (e.g. a number of steps)."""
    v = _integer(name, value)
    PrivacyParameterError.check(v >= 0, name, value, "must be an integer >= 0")
    return v


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int, checked >= 1."""
    v = _integer(name, value)
    PrivacyParameterError.check(v >= 1, name, value, "must be an integer >= 1")
    return v


def batch_within(batch_size: Any, records: Any) -> tuple[int, int]:
    """``(batch_size, records)`` checked so that the sampling rate ``q = B / m`` is in (0, 1]."""
    m = positive_int("records", records)
    b = _integer("batch_size", batch_size)
    PrivacyParameterError.check(1 <= b <= m, "batch_size", batch_size,
                                f"must be an integer in [1, records={m}] (sampling rate q = B/m in (0, 1])")
    return b, m
