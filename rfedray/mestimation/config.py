"""Configurations of the two Euclidean systems: private federated M-estimation and DDP-SA.

The project's :class:`rfedray.config.Config` describes DP-RFedProj runs (and refuses unknown
sections), so these systems have their own schemas, loaded the same way: defaults, then a YAML file
(``configs/mestimation_*.yaml``, ``configs/ddpsa_*.yaml``), then ``key=value`` overrides, type-checked
by OmegaConf; every bad value is a :class:`rfedray.config.ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from rfedray.config import ENGINES, NOISE_SEED, read_layers, structured
from rfedray.options import OPEN_UNIT, POSITIVE, POSITIVE_INT, Rule, at_least, check_fields, one_of, ranged
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
    seed: int = ranged(0, at_least(0))
    rounds: int = ranged(30, POSITIVE_INT)
    engine: str = ranged("local", one_of(ENGINES))
    num_hosts: int = ranged(2, POSITIVE_INT)
    output_dir: str = "runs"


@dataclass
class FederationSection:
    n_clients: int = ranged(5, POSITIVE_INT)
    clients_per_round: int = ranged(5, POSITIVE_INT)
    batch_size: int = ranged(64, POSITIVE_INT)


@dataclass
class PrivacySection:
    enabled: bool = True
    epsilon: Optional[float] = ranged(4.0, POSITIVE)
    delta: float = ranged(1e-5, OPEN_UNIT)
    clip: float = ranged(1.0, POSITIVE)
    noise_multiplier: Optional[float] = ranged(None, POSITIVE)
    noise_seed: Optional[int] = ranged(None, NOISE_SEED)


@dataclass
class ComponentSection:
    name: str = ""
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategySection:
    name: str = ranged("fedsgd", one_of(STRATEGIES))
    lr: float = ranged(1.0, POSITIVE)
    local_steps: int = ranged(10, POSITIVE_INT)
    local_lr: float = ranged(1.0, POSITIVE)
    switch_round: int = ranged(10, POSITIVE_INT)
    newton_steps: int = ranged(1, POSITIVE_INT)
    hessian_clip: float = ranged(1.0, POSITIVE)
    damping: float = ranged(1.0, Rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    floor: float = ranged(0.01, POSITIVE)


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
    clipping: str = ranged("private_quantile", one_of(CLIPPINGS))  # the covered adaptive variant; "median" is not covered by the guarantee
    clip: float = ranged(1.0, POSITIVE)
    lr: float = ranged(1.0, POSITIVE)
    target_quantile: float = ranged(0.5, OPEN_UNIT)
    quantile_lr: float = ranged(0.2, POSITIVE)
    budget_share: float = ranged(0.1, OPEN_UNIT)
    aggregators: int = ranged(3, at_least(2))
    frac_bits: int = ranged(24, Rule(lambda v: 0 <= v <= 40, "must be in [0, 40]"))
    min_clients: int = ranged(2, at_least(2))
    patience: int = ranged(30, POSITIVE_INT)
    min_delta: float = ranged(1e-3, POSITIVE)


@dataclass
class DDPSAConfig:
    run: RunSection = field(default_factory=lambda: RunSection(name="ddpsa", rounds=300))
    federation: FederationSection = field(default_factory=lambda: FederationSection(n_clients=10, clients_per_round=10))
    privacy: PrivacySection = field(default_factory=lambda: PrivacySection(epsilon=5.0))
    data: ComponentSection = field(default_factory=lambda: ComponentSection("sklearn", {"dataset": "synthetic_regression"}))
    model: ComponentSection = field(default_factory=lambda: ComponentSection("logreg", {"l2": 0.0}))
    ddpsa: DDPSASection = field(default_factory=DDPSASection)


def validate(cfg) -> None:
    """Every field of an :class:`MEstimationConfig` or a :class:`DDPSAConfig` (its declared rule),
    then the rules that relate fields; a :class:`ConfigError` names the first problem."""
    f, p = cfg.federation, cfg.privacy
    check_fields(cfg, "", ConfigError)
    ConfigError.check(f.clients_per_round <= f.n_clients, "federation.clients_per_round", f.clients_per_round,
                      f"must be between 1 and federation.n_clients ({f.n_clients})")
    if p.enabled and p.epsilon is None and p.noise_multiplier is None:
        raise ConfigError("privacy.epsilon", None, "give a target epsilon or a noise_multiplier (or privacy.enabled=false)")
    one_of(DATA_MODULES).check("data.name", cfg.data.name, ConfigError)
    one_of(MODEL_MODULES).check("model.name", cfg.model.name, ConfigError)
    registry.resolve_options(registry.data_module(cfg.data.name), dict(cfg.data.options), "data.options")
    registry.resolve_options(registry.model_module(cfg.model.name), dict(cfg.model.options), "model.options")
    d = getattr(cfg, "ddpsa", None)
    if d is not None and cfg.federation.clients_per_round < d.min_clients:
        raise ConfigError("federation.clients_per_round", cfg.federation.clients_per_round,
                          f"must be >= ddpsa.min_clients ({d.min_clients}): the secure sum needs that many clients")


def load(schema: type, path: Optional[str], overrides: list[str]):
    """Defaults of ``schema``, then the YAML file, then overrides; type-checked and validated."""
    cfg = structured(schema, read_layers(path, overrides))
    validate(cfg)
    return cfg
