"""Configurations of the two Euclidean systems: private federated M-estimation and DDP-SA.

The project's :class:`rfedray.config.Config` describes DP-RFedProj runs (and refuses unknown
sections), so these systems have their own schemas, loaded the same way: defaults, then a YAML file
(``configs/mestimation_*.yaml``, ``configs/ddpsa_*.yaml``), then ``key=value`` overrides, type-checked
by OmegaConf; every bad value is a :class:`rfedray.config.ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from rfedray.config import ENGINES, at_least, check_noise_seed, choice, positive, positive_int, read_layers, structured
from rfedray import registry
from rfedray.errors import ConfigError

DATA_MODULES = {name: registry.DATA_SOURCES[name] for name in ("sklearn", "vision")}
MODEL_MODULES = {name: registry.MODELS[name] for name in ("logreg", "mlp")}
"""The registry's data sources and models of the Euclidean systems."""
STRATEGIES = ("fedsgd", "fedavg", "fedhybrid", "fednewton")
CLIPPINGS = ("static", "median", "private_quantile")


@dataclass
class RunSection:
    name: str = "mestimation"
    seed: int = 0
    rounds: int = 30
    engine: str = "local"
    num_hosts: int = 2
    output_dir: str = "runs"


@dataclass
class FederationSection:
    n_clients: int = 5
    clients_per_round: int = 5
    batch_size: int = 64


@dataclass
class PrivacySection:
    enabled: bool = True
    epsilon: Optional[float] = 4.0
    delta: float = 1e-5
    clip: float = 1.0
    noise_multiplier: Optional[float] = None
    noise_seed: Optional[int] = None


@dataclass
class ComponentSection:
    name: str = ""
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategySection:
    name: str = "fedsgd"
    lr: float = 1.0
    local_steps: int = 10
    local_lr: float = 1.0
    switch_round: int = 10
    newton_steps: int = 1
    hessian_clip: float = 1.0
    damping: float = 1.0
    floor: float = 0.01


@dataclass
class MEstimationConfig:
    run: RunSection = field(default_factory=RunSection)
    federation: FederationSection = field(default_factory=FederationSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    data: ComponentSection = field(default_factory=lambda: ComponentSection("sklearn", {"dataset": "digits"}))
    model: ComponentSection = field(default_factory=lambda: ComponentSection("logreg", {}))
    strategy: StrategySection = field(default_factory=StrategySection)


@dataclass
class DDPSASection:
    clipping: str = "private_quantile"  # the covered adaptive variant; "median" is not covered by the guarantee
    clip: float = 1.0
    lr: float = 1.0
    target_quantile: float = 0.5
    quantile_lr: float = 0.2
    budget_share: float = 0.1
    aggregators: int = 3
    frac_bits: int = 24
    min_clients: int = 2
    patience: int = 30
    min_delta: float = 1e-3


@dataclass
class DDPSAConfig:
    run: RunSection = field(default_factory=lambda: RunSection(name="ddpsa", rounds=300))
    federation: FederationSection = field(default_factory=lambda: FederationSection(n_clients=10, clients_per_round=10))
    privacy: PrivacySection = field(default_factory=lambda: PrivacySection(epsilon=5.0))
    data: ComponentSection = field(default_factory=lambda: ComponentSection("sklearn", {"dataset": "synthetic_regression"}))
    model: ComponentSection = field(default_factory=lambda: ComponentSection("logreg", {"l2": 0.0}))
    ddpsa: DDPSASection = field(default_factory=DDPSASection)


def _validate_common(cfg) -> None:
    r, f, p = cfg.run, cfg.federation, cfg.privacy
    choice("run.engine", r.engine, ENGINES)
    positive_int("run.rounds", r.rounds)
    positive_int("run.num_hosts", r.num_hosts)
    at_least("run.seed", r.seed, 0)
    positive_int("federation.n_clients", f.n_clients)
    if not 1 <= f.clients_per_round <= f.n_clients:
        raise ConfigError("federation.clients_per_round", f.clients_per_round, f"must be between 1 and federation.n_clients ({f.n_clients})")
    positive_int("federation.batch_size", f.batch_size)
    ConfigError.check(0 < p.delta < 1, "privacy.delta", p.delta, "must be in (0, 1)")
    positive("privacy.clip", p.clip)
    if p.epsilon is not None:
        positive("privacy.epsilon", p.epsilon)
    if p.noise_multiplier is not None:
        positive("privacy.noise_multiplier", p.noise_multiplier)
    if p.enabled and p.epsilon is None and p.noise_multiplier is None:
        raise ConfigError("privacy.epsilon", None, "give a target epsilon or a noise_multiplier (or privacy.enabled=false)")
    check_noise_seed("privacy.noise_seed", p.noise_seed)
    choice("data.name", cfg.data.name, tuple(DATA_MODULES))
    choice("model.name", cfg.model.name, tuple(MODEL_MODULES))
    registry.resolve_options(registry.data_module(cfg.data.name), dict(cfg.data.options), "data.options")
    registry.resolve_options(registry.model_module(cfg.model.name), dict(cfg.model.options), "model.options")


def validate_mestimation(cfg: MEstimationConfig) -> None:
    _validate_common(cfg)
    s = cfg.strategy
    choice("strategy.name", s.name, STRATEGIES)
    for name in ("lr", "local_lr", "hessian_clip", "floor"):
        positive(f"strategy.{name}", getattr(s, name))
    for name in ("local_steps", "switch_round", "newton_steps"):
        positive_int(f"strategy.{name}", getattr(s, name))
    ConfigError.check(0 < s.damping <= 1, "strategy.damping", s.damping, "must be in (0, 1]")


def validate_ddpsa(cfg: DDPSAConfig) -> None:
    _validate_common(cfg)
    d = cfg.ddpsa
    choice("ddpsa.clipping", d.clipping, CLIPPINGS)
    for name in ("clip", "lr", "quantile_lr", "min_delta"):
        positive(f"ddpsa.{name}", getattr(d, name))
    for name, low in (("aggregators", 2), ("min_clients", 2), ("patience", 1)):
        at_least(f"ddpsa.{name}", getattr(d, name), low)
    ConfigError.check(0 < d.target_quantile < 1, "ddpsa.target_quantile", d.target_quantile, "must be in (0, 1)")
    ConfigError.check(0 < d.budget_share < 1, "ddpsa.budget_share", d.budget_share, "must be in (0, 1)")
    ConfigError.check(0 <= d.frac_bits <= 40, "ddpsa.frac_bits", d.frac_bits, "must be in [0, 40]")
    if cfg.federation.clients_per_round < d.min_clients:
        raise ConfigError("federation.clients_per_round", cfg.federation.clients_per_round,
                          f"must be >= ddpsa.min_clients ({d.min_clients}): the secure sum needs that many clients")


def load(schema: type, path: Optional[str], overrides: list[str]):
    """Defaults of ``schema``, then the YAML file, then overrides; type-checked and validated."""
    cfg = structured(schema, read_layers(path, overrides))
    (validate_mestimation if schema is MEstimationConfig else validate_ddpsa)(cfg)
    return cfg
