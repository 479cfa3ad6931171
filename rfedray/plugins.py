"""Models and data sources named by import path in a configuration, and the checks of user objects.

A configuration may name the user's own code instead of a built-in name::

    model:
      name: mypackage.models:spdnet      # a factory: spdnet(info, d: int = 4) -> a model
      options: {d: 6}
    data:
      source: mypackage.data:Covariances # a class: Covariances(n_clients, seed, path: str)
      options: {path: /data/covs.npz}

The options schema of a plugin is its signature: every keyword parameter is an option, typed by
its annotation (``Any`` when it has none, or one OmegaConf cannot check) and required when it has
no default, so ``model.options`` of a plugin is checked like a built-in's (unknown keys with the
closest name, wrong types, missing required values). A few parameter names are not options but
what rfedray passes in (:data:`CONTEXT`): a model factory may take ``info`` (the data's public
description, e.g. ``num_classes``) and ``retraction`` (``aggregation.retraction``); a data source
may take ``n_clients`` (``federation.n_clients``) and ``seed`` (``run.seed``).

A model is a :class:`rfedray.task.FederatedModel`, usually a
:class:`rfedray.models.module.ModuleModel`; a data source follows
:class:`rfedray.task.ClientPartitions`. :func:`check_model` and :func:`check_dataset` refuse
other objects with a message that says what is missing, for plugins and for the objects given to
:func:`rfedray.api.run` alike.

On the Ray engine every process that builds the model or the data (the server actor, the client
actors) imports the plugin again. :func:`code_locations` lists the files and folders of user code
that are not installed in the Python environment, which the Ray layer ships with the run (Ray's
``runtime_env`` ``py_modules``), so a plugin module beside the user's script imports on every node.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import site
import sys
import sysconfig
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rfedray.errors import ConfigError

CONTEXT = {"model.name": ("info", "retraction"), "data.source": ("n_clients", "seed")}
"""Parameters of a plugin that rfedray fills in (not options), by the field that names the plugin."""

MODEL_MEMBERS = ("groups", "init_params", "per_sample_loss", "evaluate")
DATASET_MEMBERS = ("num_clients", "info", "client_sizes", "client_data", "eval_data")

OWN_PACKAGES = ("rfedray", "actors")
"""Top-level packages of rfedray itself: installed wherever rfedray runs."""


def is_import_path(name: str) -> bool:
    """Whether a model name or data source is an import path ``package.module:attribute``."""
    return ":" in name


def _split(field: str, path: str) -> tuple[str, str]:
    module_name, _, attribute = path.partition(":")
    parts = [*module_name.split("."), *attribute.split(".")]
    if not all(part.isidentifier() for part in parts):
        raise ConfigError(field, path, "an import path is written package.module:name (dotted Python identifiers)")
    return module_name, attribute


def load(field: str, path: str) -> Any:
    """The object an import path names.

    Parameters
    ----------
    field : str
        ``model.name`` or ``data.source``, for the error message.
    path : str
        ``package.module:name`` (``name`` may be dotted: ``module:Class.factory``).

    Raises
    ------
    ConfigError
        When the module is not found, raises while it is imported, or has no such attribute, or the
        attribute is not callable.
    """
    module_name, attribute = _split(field, path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError(field, path, f"cannot import {module_name!r}: no module named {exc.name!r} on the Python "
                              "path; install its package or add its folder to PYTHONPATH") from None
        raise ConfigError(field, path, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # the user's module raised while it was imported
        raise ConfigError(field, path, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(field, path, f"{getattr(target, '__name__', module_name)!r} has no attribute {part!r}")
        target = getattr(target, part)
    ConfigError.check(callable(target), field, path, f"names a {type(target).__name__}; it must name a class or a function")
    return target


def _checkable(annotation: Any) -> Any:
    """``annotation`` if OmegaConf can type-check a field of it, else ``Any``."""
    try:
        OmegaConf.structured(dataclasses.make_dataclass("Probe", [("value", annotation)]))
    except (OmegaConfBaseException, TypeError, ValueError):
        return Any
    return annotation


def options_schema(field: str, path: str, target: Any) -> type:
    """The options dataclass of a plugin: one field per keyword parameter that is not in :data:`CONTEXT`.

    Raises
    ------
    ConfigError
        When a parameter can only be passed by position (options are passed by keyword).
    """
    function = target.__init__ if inspect.isclass(target) else target
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # annotations that do not evaluate here: checked as Any
        hints = {}
    specs = []
    for p in inspect.signature(target).parameters.values():
        if p.name in CONTEXT[field] or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise ConfigError(field, path, f"parameter {p.name!r} is positional-only; options are passed by keyword")
        if p.default is p.empty:
            default = dataclasses.field()
        elif isinstance(p.default, (list, dict, set)):
            default = dataclasses.field(default_factory=lambda value=p.default: copy.deepcopy(value))
        else:
            default = dataclasses.field(default=p.default)
        specs.append((p.name, _checkable(hints.get(p.name, Any)), default))
    return dataclasses.make_dataclass(f"Options[{path}]", specs, kw_only=True)


class Plugin:
    """A plugin seen as a registry module: an ``Options`` schema and a ``build`` function.

    Parameters
    ----------
    field : str
        ``model.name`` or ``data.source``.
    path : str
        Its import path.
    """

    def __init__(self, field: str, path: str):
        self.field, self.path = field, path
        self.target = load(field, path)
        self.Options = options_schema(field, path, self.target)
        self._accepts = set(inspect.signature(self.target).parameters)

    def _call(self, options: Any, context: dict[str, Any]) -> Any:
        kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        kwargs.update({k: v for k, v in context.items() if k in self._accepts})
        return self.target(**kwargs)

    def build(self, options: Any, info: Optional[dict] = None, retraction: Any = None, *,
              n_clients: Optional[int] = None, seed: Optional[int] = None) -> Any:
        """Call the plugin with its options and the context it takes; check what it returns.

        A model plugin is built as ``build(options, info, retraction=...)``, a data plugin as
        ``build(options, n_clients=..., seed=...)``, like the built-in modules.
        """
        if self.field == "model.name":
            from rfedray.geometry import STIEFEL_RETRACTIONS

            name = next((n for n, cls in STIEFEL_RETRACTIONS.items() if retraction in (cls, None)), None)
            return check_model(self.field, self.path, self._call(options, {"info": info, "retraction": name}))
        return check_dataset(self.field, self.path, self._call(options, {"n_clients": n_clients, "seed": seed}))


@lru_cache(maxsize=None)
def plugin(field: str, path: str) -> Plugin:
    """The plugin ``path`` named in ``field``, imported once per process."""
    return Plugin(field, path)


def _missing(obj: Any, members: Iterable[str]) -> list[str]:
    return [m for m in members if not hasattr(obj, m)]


def check_model(field: str, value: Any, model: Any) -> Any:
    """``model`` if it is a :class:`rfedray.task.FederatedModel`.

    Raises
    ------
    ConfigError
        Naming ``field`` (``model.name``, or ``model`` for an object given to the API) and what is
        missing; a bare ``torch.nn.Module`` is told to be wrapped in ``ModuleModel``.
    """
    missing = _missing(model, MODEL_MEMBERS)
    if not missing:
        return model
    if isinstance(model, torch.nn.Module):
        raise ConfigError(field, value, "is a torch.nn.Module; wrap it as rfedray.ModuleModel(module, loss=...) so that "
                          "rfedray knows the loss of one record")
    raise ConfigError(field, value, f"gives a {type(model).__name__}, not a federated model (missing {', '.join(missing)}); "
                      "use rfedray.ModuleModel(module, loss=...) or implement rfedray.task.FederatedModel")


def check_dataset(field: str, value: Any, dataset: Any) -> Any:
    """``dataset`` if it follows the client-partition interface (:class:`rfedray.task.ClientPartitions`).

    Raises
    ------
    ConfigError
        Naming ``field`` and the missing members.
    """
    missing = _missing(dataset, DATASET_MEMBERS)
    if missing:
        raise ConfigError(field, value, f"gives a {type(dataset).__name__}, not a federated dataset (missing "
                          f"{', '.join(missing)}); subclass rfedray.ClientPartitions")
    return dataset


def _site_folders() -> list[Path]:
    folders = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    folders.update(site.getsitepackages())
    folders.add(site.getusersitepackages())
    return [Path(f).resolve() for f in folders]


def code_location(module_name: str) -> Optional[Path]:
    """The file or folder of the top-level package of ``module_name`` if it is not installed.

    Returns
    -------
    Path or None
        The package's folder (or the module's ``.py`` file) when it is imported from outside the
        environment's site-packages (a folder on ``PYTHONPATH``, the user's working directory);
        ``None`` for installed packages, rfedray itself, ``__main__`` (Ray pickles its objects by
        value) and the standard library.
    """
    top = module_name.split(".")[0]
    if top in OWN_PACKAGES or top == "__main__" or top in sys.stdlib_module_names:
        return None
    module = sys.modules.get(top) or importlib.import_module(top)
    where = getattr(module, "__file__", None)
    if where is None:
        paths = list(getattr(module, "__path__", []))  # a namespace package
        if not paths:
            return None
        location = Path(paths[0]).resolve()
    else:
        location = Path(where).resolve()
        if hasattr(module, "__path__"):
            location = location.parent
    if any(location.is_relative_to(folder) for folder in _site_folders()):
        return None
    return location


def _object_modules(obj: Any) -> set[str]:
    """Modules whose code a pickled ``obj`` refers to: its class and their bases, and the functions
    and module a :class:`~rfedray.models.module.ModuleModel` holds."""
    names = {c.__module__ for c in type(obj).__mro__}
    for attribute in ("module", "loss", "metrics"):
        inner = getattr(obj, attribute, None) if type(obj).__name__ == "ModuleModel" else None
        if inner is not None:
            names |= {c.__module__ for c in type(inner).__mro__} | {getattr(inner, "__module__", "builtins")}
    return names


def code_locations(model_name: str, data_source: str, objects: Iterable[Any] = ()) -> list[str]:
    """The user code a run needs on every node, as local paths (Ray's ``py_modules``).

    Parameters
    ----------
    model_name, data_source : str
        ``model.name`` and ``data.source``; import paths contribute their module.
    objects : iterable
        Objects given to :func:`rfedray.api.run` (the model, the dataset).
    """
    names = {path.partition(":")[0] for path in (model_name, data_source) if is_import_path(path)}
    for obj in objects:
        names |= _object_modules(obj)
    locations = {code_location(name) for name in names}
    return sorted(str(p) for p in locations if p is not None)
