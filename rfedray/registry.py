"""Names a configuration may use for models and data sources, and their option schemas.

Each entry points to a module that defines an ``Options`` dataclass (the schema of
``model.options`` or ``data.options``) and a ``build`` function. Modules are imported only when
their name is used, so that validating a federated-PCA config does not import MNE.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from rfedray import options
from rfedray.errors import ConfigError

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
    if name not in table:
        raise ConfigError(kind, name, "must be one of " + ", ".join(sorted(table)) + options.closest(name, list(table)))
    return importlib.import_module(table[name])


def model_module(name: str) -> ModuleType:
    return _module(MODELS, "model.name", name)


def data_module(name: str) -> ModuleType:
    return _module(DATA_SOURCES, "data.source", name)


def resolve_options(module: ModuleType, values: dict[str, Any], field_prefix: str) -> Any:
    """Type-check ``values`` against ``module.Options`` and return an instance of it (see
    :func:`rfedray.options.resolve`)."""
    return options.resolve(module.Options, values, field_prefix)


def validate_options(cfg: Any) -> None:
    """Validate ``model.options`` and ``data.options`` of a :class:`rfedray.config.Config`."""
    resolve_options(model_module(cfg.model.name), dict(cfg.model.options), "model.options")
    resolve_options(data_module(cfg.data.source), dict(cfg.data.options), "data.options")
