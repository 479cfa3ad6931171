"""From a validated configuration to the objects of a federation.

Both engines call these functions: the local engine in one process, the Ray engine in each actor
(a client actor builds its own clients' data from the data spec, so records never travel).
"""

from __future__ import annotations

import torch

from rfedray import aggregation, registry
from rfedray.config import Config, ConfigError
from rfedray.federated.client import Client, LocalPlan
from rfedray.geometry import STIEFEL_RETRACTIONS
from rfedray.privacy.plan import GaussianMechanism, PrivacyPlan
from rfedray.task import FederatedDataset, FederatedModel


def build_dataset(cfg: Config) -> FederatedDataset:
    module = registry.data_module(cfg.data.source)
    options = registry.resolve_options(module, dict(cfg.data.options), "data.options")
    return module.build(options, n_clients=cfg.federation.n_clients, seed=cfg.run.seed)


def build_model(cfg: Config, info: dict) -> FederatedModel:
    module = registry.model_module(cfg.model.name)
    options = registry.resolve_options(module, dict(cfg.model.options), "model.options")
    try:
        return module.build(options, info, retraction=STIEFEL_RETRACTIONS[cfg.aggregation.retraction])
    except KeyError as exc:
        if not exc.args or exc.args[0] in info:
            raise
        raise ConfigError(
            "model.name", cfg.model.name,
            f"needs {exc.args[0]!r} from the data, which data.source={cfg.data.source} does not describe; "
            "choose a model for this data (or another data.options.representation)",
        ) from None


def build_scheme(cfg: Config) -> aggregation.AggregationScheme:
    scheme_cls = aggregation.SCHEMES[cfg.aggregation.scheme]
    return scheme_cls()


def check_client_sizes(cfg: Config, sizes: list[int]) -> None:
    """Cross-field checks that need the data: every client must hold at least B records."""
    if len(sizes) != cfg.federation.n_clients:
        raise ConfigError("federation.n_clients", cfg.federation.n_clients, f"the data source provides {len(sizes)} clients")
    smallest = min(sizes)
    if smallest < 1:
        raise ConfigError("data", f"client {sizes.index(smallest)}", "has no records; every client needs at least federation.batch_size records")
    if cfg.federation.batch_size > smallest:
        raise ConfigError(
            "federation.batch_size", cfg.federation.batch_size,
            f"must be <= the smallest client's record count ({smallest}, client {sizes.index(smallest)})",
        )


def resolve_privacy(cfg: Config, sizes: list[int]) -> PrivacyPlan:
    """The run's privacy plan: sigma calibrated for the planned run, or a given sigma checked to be
    usable at all.

    Calibration assumes the worst client: the smallest m and T participations.
    """
    from rfedray.privacy.accountants import ACCOUNTANTS, GaussianStep, calibrate_sigma

    p, fed = cfg.privacy, cfg.federation
    smallest = min(sizes)
    if not p.enabled:
        return PrivacyPlan(None, p.accountant, p.delta, None, fed.local_steps, p.noise_seed)
    accountant = ACCOUNTANTS[p.accountant]()
    sigma = p.sigma
    if sigma is None:
        sigma = calibrate_sigma(
            accountant, epsilon=p.epsilon, delta=p.delta, rounds=cfg.run.rounds,
            local_steps=fed.local_steps, batch_size=fed.batch_size, records=smallest, clip=p.clip,
        )
    elif p.epsilon is not None:
        step = GaussianStep.clipped_mean(sigma=sigma, clip=p.clip, batch_size=fed.batch_size, records=smallest)
        one_round = accountant.epsilon(step, rounds=1, local_steps=fed.local_steps, delta=p.delta)
        if one_round > p.epsilon:
            raise ConfigError(
                "privacy.sigma", sigma,
                f"a single round already spends epsilon={one_round:.4g} > privacy.epsilon={p.epsilon}; "
                "raise sigma or epsilon, or set privacy.sigma=null to calibrate",
            )
    target = p.epsilon if p.halt_at_target else None
    mechanism = GaussianMechanism(float(sigma), p.clip, fed.batch_size)
    return PrivacyPlan(mechanism, p.accountant, p.delta, target, fed.local_steps, p.noise_seed)


def local_plan(cfg: Config, privacy: PrivacyPlan) -> LocalPlan:
    """What every client does in a round: ``cfg``'s local work with ``privacy``'s mechanism."""
    fed = cfg.federation
    return LocalPlan(
        local_steps=fed.local_steps, batch_size=fed.batch_size, total_rounds=cfg.run.rounds,
        mechanism=privacy.mechanism, noise_seed=privacy.noise_seed,
    )


def build_client(cfg: Config, client_id: int, dataset: FederatedDataset, model: FederatedModel, plan: LocalPlan) -> Client:
    return Client(client_id, dataset.client_data(client_id), model, build_scheme(cfg), cfg.optim, plan)


def initial_params(cfg: Config, model: FederatedModel) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(cfg.run.seed * 7919 + 17)
    return model.init_params(generator)

