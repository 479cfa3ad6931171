"""From a validated configuration to the objects of a federation.

Both engines call these functions: the local engine in one process, the Ray engine in each actor
(a client actor builds its own clients' data from the data spec, so records never travel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rfedray import aggregation, plugins, registry
from rfedray.config import Config, ConfigError
from rfedray.errors import RfedrayError
from rfedray.federated.client import Client, LocalPlan
from rfedray.geometry import STIEFEL_RETRACTIONS, Stiefel
from rfedray.privacy.checks import PrivacyParameterError
from rfedray.privacy.mechanism import ClipShares
from rfedray.privacy.plan import GaussianMechanism, PrivacyPlan
from rfedray.task import FederatedDataset, FederatedModel, initial_theta


@dataclass(frozen=True)
class GivenTask:
    """A model and/or a dataset given as Python objects (:func:`rfedray.api.run`) instead of by name.

    Every process of the run that builds the task uses them (the Ray engine pickles them to its
    actors), so a given dataset should hold how to load each client's records, not the records.
    """

    model: Optional[FederatedModel] = None
    dataset: Optional[FederatedDataset] = None

    def objects(self) -> list:
        return [obj for obj in (self.model, self.dataset) if obj is not None]


def build_dataset(cfg: Config, given: Optional[GivenTask] = None) -> FederatedDataset:
    if given is not None and given.dataset is not None:
        return plugins.check_dataset("dataset", type(given.dataset).__name__, given.dataset)
    module = registry.data_module(cfg.data.source)
    options = registry.resolve_options(module, dict(cfg.data.options), "data.options")
    return module.build(options, n_clients=cfg.federation.n_clients, seed=cfg.run.seed)


def check_retraction(cfg: Config, model: FederatedModel) -> FederatedModel:
    """``model`` if its Stiefel groups use ``aggregation.retraction`` (a model object chooses its own).

    Raises
    ------
    ConfigError
        Naming ``aggregation.retraction`` and the group that uses another one.
    """
    wanted = STIEFEL_RETRACTIONS[cfg.aggregation.retraction]
    for name, manifold in model.groups.items():
        if isinstance(manifold, Stiefel) and type(manifold.retraction) is not wanted:
            raise ConfigError("aggregation.retraction", cfg.aggregation.retraction,
                              f"the model's group {name!r} uses {manifold.retraction!r}; build the model with the "
                              "run's retraction (ModuleModel(..., retraction=...)) or set aggregation.retraction to its own")
    return model


def clip_shares(cfg: Config) -> Optional[ClipShares]:
    """The run's group-wise clipping (``privacy.clip_shares``, checked by the configuration), or None: joint."""
    shares = cfg.privacy.clip_shares
    return None if shares is None else ClipShares.of(shares)


def check_clip_shares(cfg: Config, model: FederatedModel) -> FederatedModel:
    """``model`` if ``privacy.clip_shares`` (when set) gives a share to exactly its parameter groups.

    Raises
    ------
    ConfigError
        Naming ``privacy.clip_shares``, the unknown or missing group and the model's groups.
    """
    shares = clip_shares(cfg)
    if shares is not None:
        try:
            shares.check_groups(list(model.groups))
        except PrivacyParameterError as exc:
            raise ConfigError(f"privacy.{exc.name}", cfg.privacy.clip_shares, exc.allowed) from None
    return model


def build_model(cfg: Config, info: dict, given: Optional[GivenTask] = None) -> FederatedModel:
    if given is not None and given.model is not None:
        model = plugins.check_model("model", type(given.model).__name__, given.model)
        return check_clip_shares(cfg, check_retraction(cfg, model))
    module = registry.model_module(cfg.model.name)
    options = registry.resolve_options(module, dict(cfg.model.options), "model.options")
    try:
        model = check_retraction(cfg, module.build(options, info, retraction=STIEFEL_RETRACTIONS[cfg.aggregation.retraction]))
    except KeyError as exc:
        if not exc.args or exc.args[0] in info:
            raise
        raise ConfigError(
            "model.name", cfg.model.name,
            f"needs {exc.args[0]!r} from the data, which data.source={cfg.data.source} does not describe; "
            "choose a model for this data (or another data.options.representation)",
        ) from None
    return check_clip_shares(cfg, model)


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
        mechanism=privacy.mechanism, noise_seed=privacy.noise_seed, clip_shares=clip_shares(cfg),
    )


class DeclaredSizeMismatch(RfedrayError):
    """A client whose records do not number its entry of ``client_sizes()`` (the accountant's ``m``)."""


def build_client(cfg: Config, client_id: int, dataset: FederatedDataset, model: FederatedModel, plan: LocalPlan,
                 declared: Optional[int] = None) -> Client:
    """Client ``client_id`` with its records, loaded here.

    Parameters
    ----------
    declared : int, optional
        The client's size in ``dataset.client_sizes()`` (read from the dataset when not given).

    Raises
    ------
    DeclaredSizeMismatch
        When the client holds another number of records than its declared size: the accountant's
        sampling rate ``B / m`` comes from the declared size, so a client with fewer records than
        declared would spend more than is counted.
    """
    data = dataset.client_data(client_id)
    if declared is None:
        declared = int(dataset.client_sizes()[client_id])
    if data.num_records != declared:
        # The number it holds stays out of the message: the server sees errors, and a count of records
        # is not public unless declared.
        raise DeclaredSizeMismatch(f"client {client_id} does not hold the {declared} training records that the dataset's "
                         "client_sizes() declares; the accounting needs the true sizes")
    return Client(client_id, data, model, build_scheme(cfg), cfg.optim, plan)


def initial_params(cfg: Config, model: FederatedModel) -> dict[str, torch.Tensor]:
    return initial_theta(model, cfg.run.seed)
