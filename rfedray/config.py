"""Structured run configuration: one dataclass per section, validated before anything starts.

A configuration is built from three layers, later ones winning: the defaults below, a YAML file
(``configs/*.yaml``) and ``key=value`` overrides from the command line. :func:`load_config` merges
them with OmegaConf and :func:`validate` checks every field and the cross-field rules. Every problem
is reported as a :class:`ConfigError` naming the field, the value and what is allowed, so the CLI
can print one line and exit with status 2.

Model- and data-specific options live under ``model.options`` and ``data.options``; their schema is
the options dataclass that the chosen model or data source registers (see
:mod:`rfedray.registry`), so ``model.options.d`` is type-checked like any other field.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rfedray.errors import ConfigError
from rfedray.options import NON_NEGATIVE, POSITIVE, POSITIVE_INT, UNIT, Rule, check_fields, closest, one_of, ranged
from rfedray.privacy.randomness import SEED_BITS

ENGINES = ("ray", "local")
TEST_SETS = ("clients", "server")
"""Where the global model is evaluated (``run.test_set``; :mod:`rfedray.federated.evaluation`)."""
ACCOUNTANTS = ("exact", "prirfed")
"""Accountants a run may use: those that bound epsilon from above."""
APPROXIMATE_ACCOUNTANTS = ("clt",)
"""Accountants that only estimate epsilon: ``rfedray privacy epsilon`` read-outs, never a run."""
SCHEMES = ("projavg", "rlavg", "retavg", "kfavg")
WEIGHTINGS = ("uniform", "data_size")
RETRACTIONS = ("polar", "qr")
OPTIMIZERS = ("rsgd", "sgd", "adam")
SCHEDULES = ("constant", "step", "cosine")
PLACEMENTS = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
DEVICES = ("auto", "cpu", "cuda")
MAX_SEED = 2**32 - 1
MAX_CLIENTS = 100_000
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


NOISE_SEED = Rule(lambda v: 0 <= v < 1 << SEED_BITS, f"must be null (OS entropy) or an integer in [0, 2^{SEED_BITS})")
"""A noise seed is null (OS entropy) or an integer in ``[0, 2^128)`` (:mod:`rfedray.privacy.randomness`)."""


@dataclass
class RunConfig:
    """What to run and where its artifacts go."""

    name: str = ranged("fedpca", Rule(lambda v: isinstance(v, str) and bool(RUN_NAME.match(v)),
                                      "must be a plain name of letters, digits, '.', '_' or '-' (at most 100, not starting "
                                      "with '.' or '-'); it names the run's directory inside run.output_dir"))
    seed: int = ranged(0, Rule(lambda v: 0 <= v <= MAX_SEED, f"must be an integer in [0, {MAX_SEED}]"))
    rounds: int = ranged(50, POSITIVE_INT)
    output_dir: str = ranged("runs", Rule(bool, "must be a non-empty path"))
    engine: str = ranged("ray", one_of(ENGINES))
    checkpoint_every: int = ranged(10, POSITIVE_INT)
    evaluate_every: int = ranged(1, POSITIVE_INT)
    test_set: str = ranged("clients", one_of(TEST_SETS))  # clients: each on its own test split, the server sees a secure sum; server: its eval_data()
    threads: Optional[int] = ranged(None, POSITIVE_INT)  # torch/BLAS threads of a process that trains; None: from the work (rfedray.threads)


@dataclass
class FederationConfig:
    """Population, cohort and local work: n clients, k per round, tau steps of B records."""

    n_clients: int = ranged(10, POSITIVE_INT)
    clients_per_round: int = ranged(5, POSITIVE_INT)
    local_steps: int = ranged(10, POSITIVE_INT)
    batch_size: int = ranged(100, POSITIVE_INT)


@dataclass
class PrivacyConfig:
    """Record-level DP: clip C, noise std sigma (absolute) or calibration to (epsilon, delta)."""

    enabled: bool = True
    epsilon: Optional[float] = ranged(1.0, POSITIVE)
    delta: float = ranged(1e-5, Rule(lambda v: 0.0 < v < 1.0, "must be in the open interval (0, 1)"))
    clip: float = ranged(0.3548, POSITIVE)
    clip_shares: Optional[Dict[str, float]] = None  # {group: s_g}, sum s_g^2 = 1: group g clipped to s_g C; null: joint
    sigma: Optional[float] = ranged(None, POSITIVE)
    accountant: str = ranged("exact", one_of(ACCOUNTANTS))
    noise_seed: Optional[int] = ranged(None, NOISE_SEED)
    halt_at_target: bool = True


@dataclass
class ModelConfig:
    """The model; ``options`` is checked against the model's own options dataclass."""

    name: str = "fedpca"
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """The data source; ``options`` is checked against the source's own options dataclass."""

    source: str = "synthetic_pca"
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class AggregationConfig:
    """Server-side combination of the cohort's submissions."""

    scheme: str = ranged("projavg", one_of(SCHEMES))
    weighting: str = ranged("uniform", one_of(WEIGHTINGS))
    retraction: str = ranged("polar", one_of(RETRACTIONS))


@dataclass
class OptimizerConfig:
    """A local optimiser for one parameter group, with its learning-rate schedule."""

    name: str = ranged("rsgd", one_of(OPTIMIZERS))
    lr: float = ranged(0.5, POSITIVE)
    momentum: float = ranged(0.0, UNIT)
    beta1: float = ranged(0.9, UNIT)
    beta2: float = ranged(0.999, UNIT)
    eps: float = ranged(1e-8, POSITIVE)
    weight_decay: float = ranged(0.0, NON_NEGATIVE)
    schedule: str = ranged("constant", one_of(SCHEDULES))
    step_size: int = ranged(100, POSITIVE_INT)
    gamma: float = ranged(0.5, Rule(lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"))


@dataclass
class RayConfig:
    """How the Ray engine places client actors."""

    address: Optional[str] = None
    num_client_actors: Optional[int] = ranged(None, POSITIVE_INT)
    clients_per_actor: int = ranged(0, Rule(lambda v: v >= 0, "must be >= 0 (0 spreads clients evenly over the actors)"))
    num_cpus_per_actor: float = ranged(1.0, NON_NEGATIVE)
    num_gpus_per_actor: float = ranged(0.0, Rule(lambda v: v >= 0, "must be >= 0 (fractions pack actors on a GPU)"))
    placement: str = ranged("SPREAD", one_of(PLACEMENTS))
    round_timeout_s: float = ranged(300.0, POSITIVE)
    actor_start_timeout_s: float = ranged(1200.0, POSITIVE)
    max_restarts: int = ranged(3, Rule(lambda v: v >= -1, "must be >= -1 (-1 restarts forever)"))
    device: str = ranged("auto", one_of(DEVICES))


@dataclass
class MonitoringConfig:
    """Prometheus endpoint and console progress."""

    metrics_port: Optional[int] = ranged(None, Rule(lambda v: 0 <= v <= 65535, "must be null (off) or a port in [0, 65535]"))
    metrics_host: str = "127.0.0.1"
    linger_seconds: float = ranged(0.0, Rule(lambda v: 0.0 <= v <= 3600.0, "must be in [0, 3600]"))
    progress: bool = True
    export_oracle_metrics: bool = False  # oracle metrics (of the training records) on the progress line and Prometheus


@dataclass
class Config:
    """The whole run configuration."""

    run: RunConfig = field(default_factory=RunConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    optim: Dict[str, OptimizerConfig] = field(
        default_factory=lambda: {"default": OptimizerConfig()}
    )
    ray: RayConfig = field(default_factory=RayConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)


def _all_keys(dc: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every field of a (nested) dataclass type or instance."""
    keys = []
    for f in fields(dc):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(_all_keys(default, path + "."))
    return keys


def config_file(path: str | os.PathLike) -> Path:
    """The YAML file ``path`` names: that file, else the packaged configuration of that name.

    ``fedpca``, ``fedpca.yaml`` and ``configs/fedpca.yaml`` find the configuration shipped with
    rfedray (:func:`rfedray.paths.packaged_configs`) when there is no such file here, so the
    commands of the README work from any folder.

    Raises
    ------
    ConfigError
        When neither exists.
    """
    from rfedray.paths import packaged_config, packaged_configs

    given = Path(path)
    if given.is_file():
        return given
    packaged = packaged_config(given.name) if str(given.parent) in (".", "configs") else None
    if packaged is not None:
        return packaged
    names = ", ".join(name.removesuffix(".yaml") for name in packaged_configs())
    raise ConfigError("config", str(path), f"config file not found (packaged configurations: {names})")


def _read_yaml(path: Path) -> dict:
    path = config_file(path)
    return _parse_yaml(path.read_bytes(), str(path))


def _parse_yaml(raw: bytes, where: str) -> dict:
    """The mapping of a YAML config's bytes (``where`` names the file in errors)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("config", where, f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("config", where, f"YAML syntax error{at}: {problem}") from None
    if data is None:
        return {}
    ConfigError.check(isinstance(data, dict), "config", where, "must be a YAML mapping of sections")
    return data


def _check_unknown_keys(data: dict, schema: Any, prefix: str = "") -> None:
    """Refuse keys that are not fields, suggesting the closest valid one."""
    names = {f.name: f for f in fields(schema)}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            candidates = [f"{prefix}{n}" for n in names]
            raise ConfigError(path, value, "unknown key" + closest(path, candidates))
        f = names[key]
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default) and isinstance(value, dict):
            _check_unknown_keys(value, default, path + ".")
        elif key == "optim" and prefix == "" and isinstance(value, dict):
            for group, opt in value.items():
                if isinstance(opt, dict):
                    _check_unknown_keys(opt, OptimizerConfig, f"optim.{group}.")


def _dotlist_to_dict(overrides: list[str]) -> dict:
    for item in overrides:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("override", item.encode("utf-8", "surrogateescape"),
                              "is not UTF-8 text; write overrides in UTF-8") from None
        if "=" not in item:
            raise ConfigError("override", item, "overrides are written key=value, e.g. federation.clients_per_round=20")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError("override", " ".join(overrides), str(exc).splitlines()[0]) from None


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_layers(path: Optional[str | os.PathLike | Mapping[str, Any]] = None,
                overrides: Optional[list[str]] = None) -> dict:
    """A YAML file (if any) or a dict of sections, with ``key=value`` overrides merged over it, as a
    plain nested dict.

    Raises
    ------
    ConfigError
        For a missing file, a YAML syntax error or an override that is not ``key=value``.
    """
    if isinstance(path, Mapping):
        data: dict = dict(path)
    else:
        data = _read_yaml(Path(path)) if path is not None else {}
    if overrides:
        data = _deep_merge(data, _dotlist_to_dict(overrides))
    return data


def structured(schema: type, data: dict) -> Any:
    """``data`` merged onto the defaults of the dataclass ``schema``, type-checked (not validated).

    Raises
    ------
    ConfigError
        For an unknown key (naming the closest valid one) or a value of the wrong type.
    """
    _check_unknown_keys(data, schema)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), data)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError(str(key), getattr(exc, "value", None), str(exc).splitlines()[0]) from None
    return OmegaConf.to_object(merged)


def load_config(path: Optional[str | os.PathLike | Mapping[str, Any]] = None,
                overrides: Optional[list[str]] = None) -> Config:
    """Defaults, then a YAML file (or a dict of sections), then ``key=value`` overrides; validated.

    Raises
    ------
    ConfigError
        For a missing file, a YAML syntax error, an unknown key, a wrong type or any value outside
        its allowed range.
    """
    return config_from_dict(read_layers(path, overrides))


def load_config_text(raw: bytes, where: str, overrides: Optional[list[str]] = None) -> Config:
    """:func:`load_config` of a config file's bytes read elsewhere (a run directory in object storage)."""
    return config_from_dict(read_layers(_parse_yaml(raw, where), overrides))


def config_from_dict(data: dict) -> Config:
    """Merge a plain nested dict onto the defaults, type-check it and validate it."""
    cfg: Config = structured(Config, data)
    validate(cfg)
    return cfg


def split_items(items: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """``[CONFIG] [key=value ...]`` as the config file (or None) and the overrides: the first item
    is the file unless it looks like ``key=value``."""
    items = list(items)
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def load_items(items: Sequence[str], extra: Sequence[str] = ()) -> Config:
    """The configuration of ``[CONFIG] [key=value ...]`` with ``extra`` overrides after them."""
    path, overrides = split_items(items)
    return load_config(path, [*overrides, *extra])


def to_dict(cfg: Any) -> dict:
    """A resolved configuration (any schema) as a plain nested dict (what :func:`load_config` takes)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    """A resolved configuration (any schema) as YAML (what ``config show`` prints and runs save)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def validate(cfg: Config) -> None:
    """Check every field (its declared :class:`~rfedray.options.Rule`) and the cross-field rules;
    raise :class:`ConfigError` on the first problem."""
    fed, p = cfg.federation, cfg.privacy
    if p.accountant in APPROXIMATE_ACCOUNTANTS:
        raise ConfigError(
            "privacy.accountant", p.accountant,
            f"must be one of {', '.join(ACCOUNTANTS)}: {p.accountant} is an approximation, not an upper bound on epsilon, "
            "so it cannot calibrate, charge or halt a run (read budgets with it: rfedray privacy epsilon --accountant clt)",
        )
    check_fields(cfg, "", ConfigError)
    ConfigError.check(fed.n_clients <= MAX_CLIENTS, "federation.n_clients", fed.n_clients,
                      f"must be at most {MAX_CLIENTS} (every round rewrites each client's budget in budget.json)")
    ConfigError.check(fed.clients_per_round <= fed.n_clients, "federation.clients_per_round", fed.clients_per_round,
                      f"must be between 1 and federation.n_clients ({fed.n_clients})")
    if p.clip_shares is not None:
        from rfedray.privacy.checks import PrivacyParameterError
        from rfedray.privacy.mechanism import ClipShares

        try:
            ClipShares.of(p.clip_shares)
        except PrivacyParameterError as exc:
            raise ConfigError(f"privacy.{exc.name}", exc.value, exc.allowed) from None
    if p.enabled and p.epsilon is None and p.sigma is None:
        raise ConfigError("privacy.epsilon", None, "give a target epsilon (sigma is then calibrated) or a sigma")

    ConfigError.check(cfg.optim, "optim", {}, "needs at least a 'default' optimiser")
    for group, opt in cfg.optim.items():
        check_fields(opt, f"optim.{group}", ConfigError)

    # Model and data options are validated by their registered schemas.
    from rfedray import registry

    registry.validate_options(cfg)
