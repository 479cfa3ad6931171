"""Names a configuration may use for models and data sources, and their option schemas.

Each entry points to a module that defines an ``Options`` dataclass (the schema of
``model.options`` or ``data.options``) and a ``build`` function. Modules are imported only when
their name is used, so that validating a federated-PCA config does not import MNE.

Besides these names, ``model.name`` and ``data.source`` may be an import path
``package.module:name`` of the user's own code (:mod:`rfedray.plugins`), or :data:`GIVEN`: the
model or dataset is a Python object given to :func:`rfedray.api.run`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from rfedray import options, plugins
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

GIVEN = "python-object"
"""``model.name`` or ``data.source`` of a run whose model or dataset is a Python object (the API)."""


class GivenObject:
    """The registry entry of :data:`GIVEN`: no options, and nothing a configuration alone can build."""

    @dataclass
    class Options:
        pass

    def __init__(self, kind: str):
        self.kind = kind

    def build(self, *args: Any, **kwargs: Any) -> Any:
        argument = "model" if self.kind == "model.name" else "dataset"
        raise ConfigError(self.kind, GIVEN, f"the run's {argument} was a Python object given to rfedray.run({argument}=...); "
                          "a configuration alone cannot build it: run (or resume) it from Python with the same object, "
                          "or name a factory by import path (package.module:name)")


def _module(table: dict[str, str], kind: str, name: str) -> Any:
    if name == GIVEN:
        return GivenObject(kind)
    if plugins.is_import_path(name):
        return plugins.plugin(kind, name)
    if name not in table:
        raise ConfigError(kind, name, "must be one of " + ", ".join(sorted(table)) + options.closest(name, list(table))
                          + ", or an import path package.module:name of your own")
    return importlib.import_module(table[name])


def model_module(name: str) -> Any:
    """The module (or plugin) that builds the model ``model.name``: an ``Options`` schema and ``build``."""
    return _module(MODELS, "model.name", name)


def data_module(name: str) -> Any:
    """The module (or plugin) that builds the data source ``data.source``: an ``Options`` schema and ``build``."""
    return _module(DATA_SOURCES, "data.source", name)


def resolve_options(module: Any, values: dict[str, Any], field_prefix: str) -> Any:
    """Type-check ``values`` against ``module.Options`` and return an instance of it (see
    :func:`rfedray.options.resolve`)."""
    return options.resolve(module.Options, values, field_prefix)


def validate_options(cfg: Any) -> None:
    """Validate ``model.options`` and ``data.options`` of a :class:`rfedray.config.Config`."""
    resolve_options(model_module(cfg.model.name), dict(cfg.model.options), "model.options")
    resolve_options(data_module(cfg.data.source), dict(cfg.data.options), "data.options")
