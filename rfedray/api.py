"""The Python API: ``rfedray run`` from Python, with your own model and data if you have them.

It reads like the command line, ``rfedray run [CONFIG] [key=value ...] --engine local``::

    import rfedray

    result = rfedray.run("configs/fedpca.yaml", "run.rounds=5", engine="local")
    result.summary["epsilon_spent"]     # what summary.json says
    result.metrics[-1]                  # the last round's line of metrics.jsonl
    result.final_params                 # {group: tensor}, model_final.pt
    result.run_dir                      # runs/<run-id>/

``config`` is a YAML file, a dict of sections (``{"run": {"rounds": 5}}``), a
:class:`~rfedray.config.Config`, or ``None`` for the defaults; ``key=value`` overrides follow it.
``model`` and ``dataset`` take the user's objects instead of the configuration's ``model`` and
``data`` sections: a :class:`~rfedray.models.module.ModuleModel` (or any
:class:`~rfedray.task.FederatedModel`) and a :class:`~rfedray.task.ClientPartitions`. The saved
``config.yaml`` then names them ``python-object``; the same objects are needed to resume. A
configuration may also name the user's code by import path (``model.name:
"package.module:factory"``, :mod:`rfedray.plugins`), which the command line runs too.

Errors are the command line's: a :class:`~rfedray.errors.RfedrayError` (a
:class:`~rfedray.errors.ConfigError` for a bad value) with the one-line message the CLI prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from rfedray.config import Config, DataConfig, ModelConfig, load_config, to_dict, validate
from rfedray.errors import ConfigError
from rfedray.federated.rundir import RunDirectory, new_run_id
from rfedray.federated.setup import GivenTask
from rfedray.registry import GIVEN
from rfedray.runner import resume_config, run_discarding_refused

ConfigLike = Config | Mapping[str, Any] | str | os.PathLike | None


def load(config: ConfigLike = None, *overrides: str) -> Config:
    """The configuration a run would use: defaults, ``config``, then ``key=value`` overrides; validated.

    Parameters
    ----------
    config : path, dict, Config or None
        A YAML file, a dict of sections, a configuration, or ``None`` (the defaults).
    *overrides : str
        ``"section.key=value"``, as on the command line.

    Raises
    ------
    ConfigError
        Naming the first field that is not allowed.
    """
    return load_config(to_dict(config) if isinstance(config, Config) else config, list(overrides))


@dataclass(frozen=True)
class RunResult:
    """What a run left: its directory, summary, configuration, per-round metrics and final model.

    Attributes
    ----------
    run_dir : Path
        ``runs/<run-id>/`` (see :mod:`rfedray.federated.rundir`).
    summary : dict
        The run's ``summary.json``: ``epsilon_spent``, ``final_metrics``, ``halted``, ...
    config : Config
        The configuration that ran.
    """

    run_dir: Path
    summary: dict
    config: Config

    @property
    def metrics(self) -> list[dict]:
        """One dict per completed round (``metrics.jsonl`` without its events): ``round``,
        ``epsilon_spent``, ``metric_<name>``, timings."""
        return [r for r in RunDirectory(self.run_dir).read_metrics() if "event" not in r]

    @property
    def final_params(self) -> dict[str, Tensor]:
        """The final model, ``{group: tensor}`` (the parameters by name for a module)."""
        return torch.load(RunDirectory(self.run_dir).final_model, map_location="cpu", weights_only=True)

    def load_into(self, module: nn.Module) -> nn.Module:
        """Copy the final parameters into ``module`` (by parameter name) and return it.

        Raises
        ------
        KeyError
            If ``module`` lacks one of the model's parameters.
        """
        own = dict(module.named_parameters())
        with torch.no_grad():
            for name, value in self.final_params.items():
                own[name].copy_(value)
        return module


def run(
    config: ConfigLike = None,
    *overrides: str,
    model: Any = None,
    dataset: Any = None,
    engine: Optional[str] = None,
    quiet: bool = False,
    resume: str | os.PathLike | None = None,
) -> RunResult:
    """Run a federation, as ``rfedray run`` does, and return what it left.

    Parameters
    ----------
    config : path, dict, Config or None
        See :func:`load`. Not with ``resume``, which runs the run directory's own configuration.
    *overrides : str
        ``"section.key=value"`` overrides.
    model : FederatedModel, optional
        The user's model, e.g. ``ModuleModel(net, loss=F.cross_entropy)``; replaces ``model``.
    dataset : ClientPartitions, optional
        The user's data; replaces ``data``.
    engine : {"local", "ray"}, optional
        Overrides ``run.engine``.
    quiet : bool
        One plain progress line per round instead of a live line (``monitoring.progress=false``
        turns progress off).
    resume : path, optional
        A run directory to continue from its checkpoint (``--resume``).

    Returns
    -------
    RunResult

    Raises
    ------
    RfedrayError
        For a bad configuration, data or environment (before anything is charged), or a failed run.
    """
    extra = (f"run.engine={engine}",) if engine is not None else ()
    if resume is not None:
        if config is not None:
            raise ConfigError("config", config, "give overrides only with resume=; the configuration is the run "
                              "directory's config.yaml")
        run_dir = RunDirectory(str(resume))
        cfg = resume_config(run_dir, [*overrides, *extra])
    else:
        cfg = load(config, *overrides, *extra)
    given = GivenTask(model, dataset) if model is not None or dataset is not None else None
    if model is not None:
        cfg = replace(cfg, model=ModelConfig(name=GIVEN))
    if dataset is not None:
        cfg = replace(cfg, data=DataConfig(source=GIVEN))
    validate(cfg)
    if resume is None:
        run_dir = RunDirectory.create(cfg.run.output_dir, new_run_id(cfg.run.name))
    summary = run_discarding_refused(cfg, run_dir, quiet=quiet, resume=resume is not None, given=given)
    return RunResult(run_dir.path, summary, cfg)
