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

import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rfedray.errors import ConfigError
from rfedray.options import closest

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


@dataclass
class RunConfig:
    """What to run and where its artifacts go."""

    name: str = "fedpca"
    seed: int = 0
    rounds: int = 50
    output_dir: str = "runs"
    engine: str = "ray"
    checkpoint_every: int = 10
    evaluate_every: int = 1
    test_set: str = "clients"  # clients: each on its own test split, the server sees a secure sum; server: its eval_data()
    threads: Optional[int] = None  # torch/BLAS threads of a process that trains; None: from the work (rfedray.threads)


@dataclass
class FederationConfig:
    """Population, cohort and local work: n clients, k per round, tau steps of B records."""

    n_clients: int = 10
    clients_per_round: int = 5
    local_steps: int = 10
    batch_size: int = 100


@dataclass
class PrivacyConfig:
    """Record-level DP: clip C, noise std sigma (absolute) or calibration to (epsilon, delta)."""

    enabled: bool = True
    epsilon: Optional[float] = 1.0
    delta: float = 1e-5
    clip: float = 0.3548
    clip_shares: Optional[Dict[str, float]] = None  # {group: s_g}, sum s_g^2 = 1: group g clipped to s_g C; null: joint
    sigma: Optional[float] = None
    accountant: str = "exact"
    noise_seed: Optional[int] = None
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

    scheme: str = "projavg"
    weighting: str = "uniform"
    retraction: str = "polar"


@dataclass
class OptimizerConfig:
    """A local optimiser for one parameter group, with its learning-rate schedule."""

    name: str = "rsgd"
    lr: float = 0.5
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"
    step_size: int = 100
    gamma: float = 0.5


@dataclass
class RayConfig:
    """How the Ray engine places client actors."""

    address: Optional[str] = None
    num_client_actors: Optional[int] = None
    clients_per_actor: int = 0
    num_cpus_per_actor: float = 1.0
    num_gpus_per_actor: float = 0.0
    placement: str = "SPREAD"
    round_timeout_s: float = 300.0
    actor_start_timeout_s: float = 1200.0
    max_restarts: int = 3
    device: str = "auto"


@dataclass
class MonitoringConfig:
    """Prometheus endpoint and console progress."""

    metrics_port: Optional[int] = None
    metrics_host: str = "127.0.0.1"
    linger_seconds: float = 0.0
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


def choice(fieldname: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(fieldname, value, "must be one of " + ", ".join(allowed) + closest(str(value), list(allowed)).replace("did you mean", "closest"))


def at_least(fieldname: str, value: int, low: int) -> None:
    ConfigError.check(value >= low, fieldname, value, f"must be an integer >= {low}")


def positive_int(fieldname: str, value: int) -> None:
    at_least(fieldname, value, 1)


def positive(fieldname: str, value: float) -> None:
    ConfigError.check(value > 0 and math.isfinite(value), fieldname, value, "must be a finite number > 0")


def check_noise_seed(fieldname: str, seed: Optional[int]) -> None:
    """A noise seed is null (OS entropy) or an integer in ``[0, 2^128)`` (:mod:`rfedray.privacy.randomness`)."""
    from rfedray.privacy.randomness import SEED_BITS

    if seed is not None and not 0 <= seed < 1 << SEED_BITS:
        raise ConfigError(fieldname, seed, f"must be null (OS entropy) or an integer in [0, 2^{SEED_BITS})")


def validate(cfg: Config) -> None:
    """Check every field and the cross-field rules; raise :class:`ConfigError` on the first problem."""
    r, fed, p, agg = cfg.run, cfg.federation, cfg.privacy, cfg.aggregation
    choice("run.engine", r.engine, ENGINES)
    positive_int("run.rounds", r.rounds)
    positive_int("run.checkpoint_every", r.checkpoint_every)
    positive_int("run.evaluate_every", r.evaluate_every)
    choice("run.test_set", r.test_set, TEST_SETS)
    if r.threads is not None:
        positive_int("run.threads", r.threads)
    ConfigError.check(0 <= r.seed <= MAX_SEED, "run.seed", r.seed, f"must be an integer in [0, {MAX_SEED}]")
    if not isinstance(r.name, str) or not RUN_NAME.match(r.name):
        raise ConfigError("run.name", r.name, "must be a plain name of letters, digits, '.', '_' or '-' (at most 100, "
                          "not starting with '.' or '-'); it names the run's directory inside run.output_dir")
    ConfigError.check(r.output_dir, "run.output_dir", r.output_dir, "must be a non-empty path")

    positive_int("federation.n_clients", fed.n_clients)
    ConfigError.check(fed.n_clients <= MAX_CLIENTS, "federation.n_clients", fed.n_clients,
                      f"must be at most {MAX_CLIENTS} (every round rewrites each client's budget in budget.json)")
    positive_int("federation.clients_per_round", fed.clients_per_round)
    ConfigError.check(fed.clients_per_round <= fed.n_clients, "federation.clients_per_round", fed.clients_per_round,
                      f"must be between 1 and federation.n_clients ({fed.n_clients})")
    positive_int("federation.local_steps", fed.local_steps)
    positive_int("federation.batch_size", fed.batch_size)

    if p.accountant in APPROXIMATE_ACCOUNTANTS:
        raise ConfigError(
            "privacy.accountant", p.accountant,
            f"must be one of {', '.join(ACCOUNTANTS)}: {p.accountant} is an approximation, not an upper bound on epsilon, "
            "so it cannot calibrate, charge or halt a run (read budgets with it: rfedray privacy epsilon --accountant clt)",
        )
    choice("privacy.accountant", p.accountant, ACCOUNTANTS)
    ConfigError.check(0.0 < p.delta < 1.0, "privacy.delta", p.delta, "must be in the open interval (0, 1)")
    positive("privacy.clip", p.clip)
    if p.clip_shares is not None:
        from rfedray.privacy.checks import PrivacyParameterError
        from rfedray.privacy.mechanism import ClipShares

        try:
            ClipShares.of(p.clip_shares)
        except PrivacyParameterError as exc:
            raise ConfigError(f"privacy.{exc.name}", exc.value, exc.allowed) from None
    if p.epsilon is not None:
        positive("privacy.epsilon", p.epsilon)
    if p.sigma is not None:
        positive("privacy.sigma", p.sigma)
    if p.enabled and p.epsilon is None and p.sigma is None:
        raise ConfigError("privacy.epsilon", None, "give a target epsilon (sigma is then calibrated) or a sigma")
    check_noise_seed("privacy.noise_seed", p.noise_seed)

    choice("aggregation.scheme", agg.scheme, SCHEMES)
    choice("aggregation.weighting", agg.weighting, WEIGHTINGS)
    choice("aggregation.retraction", agg.retraction, RETRACTIONS)

    ConfigError.check(cfg.optim, "optim", {}, "needs at least a 'default' optimiser")
    for group, opt in cfg.optim.items():
        base = f"optim.{group}"
        choice(f"{base}.name", opt.name, OPTIMIZERS)
        positive(f"{base}.lr", opt.lr)
        ConfigError.check(0.0 <= opt.momentum < 1.0, f"{base}.momentum", opt.momentum, "must be in [0, 1)")
        for b in ("beta1", "beta2"):
            ConfigError.check(0.0 <= getattr(opt, b) < 1.0, f"{base}.{b}", getattr(opt, b), "must be in [0, 1)")
        positive(f"{base}.eps", opt.eps)
        ConfigError.check(opt.weight_decay >= 0, f"{base}.weight_decay", opt.weight_decay, "must be >= 0")
        choice(f"{base}.schedule", opt.schedule, SCHEDULES)
        positive_int(f"{base}.step_size", opt.step_size)
        ConfigError.check(0.0 < opt.gamma <= 1.0, f"{base}.gamma", opt.gamma, "must be in (0, 1]")

    ray = cfg.ray
    if ray.num_client_actors is not None:
        positive_int("ray.num_client_actors", ray.num_client_actors)
    if ray.clients_per_actor < 0:
        raise ConfigError("ray.clients_per_actor", ray.clients_per_actor, "must be >= 0 (0 spreads clients evenly over the actors)")
    ConfigError.check(ray.num_cpus_per_actor >= 0, "ray.num_cpus_per_actor", ray.num_cpus_per_actor, "must be >= 0")
    if ray.num_gpus_per_actor < 0:
        raise ConfigError("ray.num_gpus_per_actor", ray.num_gpus_per_actor, "must be >= 0 (fractions pack actors on a GPU)")
    choice("ray.placement", ray.placement, PLACEMENTS)
    positive("ray.round_timeout_s", ray.round_timeout_s)
    positive("ray.actor_start_timeout_s", ray.actor_start_timeout_s)
    ConfigError.check(ray.max_restarts >= -1, "ray.max_restarts", ray.max_restarts, "must be >= -1 (-1 restarts forever)")
    choice("ray.device", ray.device, DEVICES)

    mon = cfg.monitoring
    if mon.metrics_port is not None and not (0 <= mon.metrics_port <= 65535):
        raise ConfigError("monitoring.metrics_port", mon.metrics_port, "must be null (off) or a port in [0, 65535]")
    if not (0.0 <= mon.linger_seconds <= 3600.0):
        raise ConfigError("monitoring.linger_seconds", mon.linger_seconds, "must be in [0, 3600]")

    # Model and data options are validated by their registered schemas.
    from rfedray import registry

    registry.validate_options(cfg)
