"""Options of models and data sources: their error type, their dtypes, and typed parsing.

A model or data module declares an ``Options`` dataclass (the schema of ``model.options`` or
``data.options``) and a ``build(options, ...)`` function; it never sees the run's configuration.
:func:`resolve` turns a plain mapping into an ``Options`` instance (unknown keys refused with the
closest valid one, types checked by OmegaConf, required ones present, then the dataclass's own
``validate(prefix)``), and every problem is an :class:`OptionsError` naming the option, so the CLI prints one line.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any, Mapping

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


def resolve(schema: type, options: Mapping[str, Any], prefix: str) -> Any:
    """``options`` as an instance of the dataclass ``schema``, type-checked and validated.

    Parameters
    ----------
    schema : dataclass type
        An ``Options`` class; its optional ``validate(prefix)`` method checks ranges.
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
