"""Options of models and data sources: their error type, their dtypes, and typed parsing.

A model or data module declares an ``Options`` dataclass (the schema of ``model.options`` or
``data.options``) and a ``build(options, ...)`` function; it never sees the run's configuration.
:func:`resolve` turns a plain mapping into an ``Options`` instance (unknown keys refused with the
closest valid one, types checked by OmegaConf, required ones present, then the dataclass's own
``validate(prefix)``), and every problem is an :class:`OptionsError` naming the option, so the CLI prints one line.

A field declares its allowed values where it is declared: ``d: int = ranged(40, at_least(2))``.
:func:`check_fields` checks every such field of a dataclass (the run configuration's sections and
the options alike), so a schema is a table of names, types, defaults and ranges, and its
``validate`` only adds the rules that relate two fields.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Mapping, Type

import torch
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rfedray.errors import ConfigError

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""The floating-point types a model or a data source may be asked for, by name."""


class OptionsError(ConfigError):
    """A model or data option that is not allowed: ``model.options.d=0: must be an integer >= 1``."""


def closest(key: str, candidates: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the candidate closest to ``key``, or ``""``."""
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclass(frozen=True)
class Rule:
    """The allowed values of one field: ``ok(value)`` decides, ``allowed`` says what they are."""

    ok: Callable[[Any], bool]
    allowed: str
    names: tuple = ()  # the allowed names, to suggest the closest one

    def check(self, name: str, value: Any, error: Type[ConfigError] = OptionsError) -> None:
        """Raise ``error(name, value, allowed)`` (with the closest allowed name, where the values are
        names) unless ``value`` is allowed; null is left to the type (OmegaConf refuses it unless
        the field is ``Optional``)."""
        if value is not None and not self.ok(value):
            raise error(name, value, self.allowed + closest(str(value), list(self.names)).replace("did you mean", "closest"))


def at_least(low: int, note: str = "") -> Rule:
    """An integer ``>= low``; ``note`` explains the bound in the error."""
    return Rule(lambda v: v >= low, f"must be an integer >= {low}{note}")


def one_of(allowed) -> Rule:
    """One of the names ``allowed`` (a tuple, or a dict's keys)."""
    return Rule(lambda v: v in allowed, "must be one of " + ", ".join(allowed), tuple(allowed))


POSITIVE_INT = at_least(1)
POSITIVE = Rule(lambda v: v > 0 and math.isfinite(v), "must be a finite number > 0")
POSITIVE_NUMBER = Rule(lambda v: v > 0, "must be > 0")
NON_NEGATIVE = Rule(lambda v: v >= 0, "must be >= 0")
OPEN_UNIT = Rule(lambda v: 0 < v < 1, "must be in (0, 1)")
UNIT = Rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")


def ranged(default: Any, rule: Rule) -> Any:
    """A dataclass field with a default (a list is copied for each instance) whose values must satisfy ``rule``."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


def check_fields(obj: Any, prefix: str, error: Type[ConfigError] = OptionsError) -> None:
    """Raise ``error("prefix.name", value, rule.allowed)`` for the first field of the dataclass
    ``obj`` whose value breaks the :class:`Rule` it was declared with (:func:`ranged`); a field that
    is itself a dataclass (a configuration's section) is checked the same way, with its name as prefix."""
    for f in fields(obj):
        name, value = f"{prefix}.{f.name}".lstrip("."), getattr(obj, f.name)
        if "rule" in f.metadata:
            f.metadata["rule"].check(name, value, error)
        elif is_dataclass(value):
            check_fields(value, name, error)


class Checked:
    """Base of an options dataclass whose fields declare their allowed values (:func:`ranged`):
    ``validate(prefix)`` checks them; a subclass extends it with the rules that relate fields."""

    def validate(self, prefix: str) -> None:
        check_fields(self, prefix)


def resolve(schema: type, options: Mapping[str, Any], prefix: str) -> Any:
    """``options`` as an instance of the dataclass ``schema``, type-checked and validated.

    Parameters
    ----------
    schema : dataclass type
        An ``Options`` class; its optional ``validate(prefix)`` method checks ranges
        (:class:`Checked`: those its fields declare).
    options : mapping
        Option name to value.
    prefix : str
        Where the options sit in the configuration (``model.options``), for error messages.

    Raises
    ------
    OptionsError
        For an unknown option, a wrong type or a value out of range.
    """
    names = [f.name for f in fields(schema)]
    for key, value in options.items():
        if key not in names:
            raise OptionsError(f"{prefix}.{key}", value, "unknown key" + closest(key, names))
    try:
        resolved = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(options)))
    except MissingMandatoryValue as exc:
        raise OptionsError(f"{prefix}.{exc.full_key}", None, "is required (it has no default)") from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        raise OptionsError(f"{prefix}.{key}".rstrip("."), getattr(exc, "value", None), str(exc).splitlines()[0]) from None
    check = getattr(resolved, "validate", None)
    if check is not None:
        check(prefix)
    return resolved
