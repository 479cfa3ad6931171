"""Errors meant for the user: the CLI prints their message on one line, without a traceback."""

from __future__ import annotations

from typing import Any, Iterable


class RfedrayError(Exception):
    """A problem the user can fix (bad input, unusable environment); exit status 2 in the CLI."""

    exit_code = 2


class ConfigError(RfedrayError, ValueError):
    """A setting that is not allowed: ``field=value: what is allowed``.

    Parameters
    ----------
    field : str
        Dotted path of the offending setting, e.g. ``federation.clients_per_round``.
    value : Any
        The value that was given.
    allowed : str
        What would have been accepted.
    """

    def __init__(self, field: str, value: Any, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r}: {allowed}")

    def __reduce__(self):
        # Picklable with its three arguments, so it crosses process (Ray) boundaries intact.
        return (type(self), (self.field, self.value, self.allowed))

    @classmethod
    def check(cls, ok: object, field: str, value: Any, allowed: str) -> None:
        """Raise ``cls(field, value, allowed)`` unless ``ok``: a range check in one line,
        ``OptionsError.check(d >= 2, "data.options.d", d, "must be an integer >= 2")``."""
        if not ok:
            raise cls(field, value, allowed)

    @classmethod
    def one_of(cls, field: str, value: Any, allowed: Iterable[str]) -> None:
        """Raise ``cls(field, value, "must be one of A, B, ...")`` unless ``value`` is in ``allowed``."""
        cls.check(value in allowed, field, value, "must be one of " + ", ".join(allowed))


class RunFailure(RfedrayError):
    """A run that failed after it started (its server died, its cluster went away): exit status 1.

    Problems with the input (configuration, data, paths) are plain :class:`RfedrayError`, exit
    status 2, and are refused before anything is charged.
    """

    exit_code = 1
