"""Names a configuration may use for models and data sources, and their option schemas.

Each entry points to a module that defines an ``Options`` dataclass (the schema of
``model.options`` or ``data.options``) and a ``build`` function. Modules are imported only when
their name is used, so that validating a federated-PCA config does not import MNE.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from types import ModuleType
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

MODELS = {
    "fedpca": "rfedray.models.fedpca",
    "spdnet": "rfedray.models.spdnet",
    "eegnet": "rfedray.models.eegnet",
    "logreg": "rfedray.models.logreg",
    "mlp": "rfedray.models.mlp",
}

DATA_SOURCES = {
    "synthetic_pca": "rfedray.data.synthetic_pca",
    "synthetic_eeg": "rfedray.data.synthetic_eeg",
    "moabb": "rfedray.data.eeg",
    "sklearn": "rfedray.data.sklearn_data",
    "vision": "rfedray.data.vision",
    "arrays": "rfedray.data.arrays",
}


def _module(table: dict[str, str], kind: str, name: str) -> ModuleType:
    from rfedray.config import ConfigError, _closest

    if name not in table:
        raise ConfigError(kind, name, "must be one of " + ", ".join(sorted(table)) + _closest(name, list(table)))
    return importlib.import_module(table[name])


def model_module(name: str) -> ModuleType:
    return _module(MODELS, "model.name", name)


def data_module(name: str) -> ModuleType:
    return _module(DATA_SOURCES, "data.source", name)


def resolve_options(module: ModuleType, options: dict[str, Any], field_prefix: str) -> Any:
    """Type-check ``options`` against ``module.Options`` and return an instance of it."""
    from rfedray.config import ConfigError, _closest

    schema = module.Options
    names = [f.name for f in fields(schema)]
    for key, value in options.items():
        if key not in names:
            raise ConfigError(f"{field_prefix}.{key}", value, "unknown key" + _closest(key, names))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), options)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        raise ConfigError(f"{field_prefix}.{key}".rstrip("."), getattr(exc, "value", None), str(exc).splitlines()[0]) from None
    resolved = OmegaConf.to_object(merged)
    check = getattr(resolved, "validate", None)
    if check is not None:
        check(field_prefix)
    return resolved


def validate_options(cfg: Any) -> None:
    """Validate ``model.options`` and ``data.options`` of a :class:`rfedray.config.Config`."""
    resolve_options(model_module(cfg.model.name), dict(cfg.model.options), "model.options")
    resolve_options(data_module(cfg.data.source), dict(cfg.data.options), "data.options")
