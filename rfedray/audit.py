"""Empirical privacy audit of private federated PCA: a canary record and a membership test.

::

    rfedray audit [CONFIG] [key=value ...] [--trials N] [--noise-scale S] [--clip-scale S]
                  [--canary-norm R] [--canary-client I] [--confidence P] [--seed S] [--json]

The audit trains the configured federated-PCA federation ``2 N`` times, from the same starting
point and with the same (public) cohorts: ``N`` times on the data ``D'`` and ``N`` times on ``D``,
where ``D`` replaces the first record of client ``I`` by a canary ``z* = R u``. The direction
``u`` is orthogonal to the data's top-p subspace (so the honest data never pulls the model there)
and the starting model holds half of it (where the canary's gradient is largest). ``D`` and ``D'`` differ in one record: the replace-one adjacency of the
accountant. The score of a trained model ``P`` is its projection energy on the canary direction,
``u^T P u``.

A membership test "``D`` if the score exceeds ``t``" has false-positive rate ``FPR`` (under ``D'``)
and false-negative rate ``FNR`` (under ``D``); an ``(epsilon, delta)``-DP training run forces
``FPR + e^epsilon FNR >= 1 - delta`` and ``FNR + e^epsilon FPR >= 1 - delta``. The threshold is
chosen on the first half of the trials (the one giving the largest bound there); on the second half
the Clopper-Pearson upper bounds of ``FPR`` and ``FNR`` (each at level ``(1 - P)/2``) turn these
inequalities into a lower bound on epsilon that holds with probability at least ``P``. A correct
mechanism keeps it below the accountant's epsilon for the canary's client (the claim); a bound
above the claim is a violation, found with confidence ``P``.

``--noise-scale`` and ``--clip-scale`` multiply the noise and the clip the clients actually use,
while the claim stays the accountant's for the configured ones: they break the mechanism on
purpose (noise off: ``--noise-scale 1e-3``; clipping off: ``--clip-scale 1e4`` with a huge
canary, ``--canary-norm 100``), to show that the audit sees a broken mechanism.

Each trial runs the library's own mechanism (cohort draw, :class:`~rfedray.federated.client.Client`
local training, :class:`~rfedray.federated.server.Server` aggregation) but no run directory and no
ledger: the accounting does not change the trained model, it is computed once, and hundreds of
trials then take seconds. The trials' noise comes from the operating system's entropy unless
``--seed`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Optional

import numpy as np
import torch
from scipy import stats

from rfedray.config import Config, ConfigError
from rfedray.federated.client import LocalResult
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.loop import Federation
from rfedray.federated.server import Server, cohort
from rfedray.federated.setup import build_scheme, initial_params, local_plan
from rfedray.models.fedpca import GROUP
from rfedray.task import ClientData, FederatedDataset, Params


@dataclasses.dataclass(frozen=True)
class AuditPlan:
    """How to audit.

    Attributes
    ----------
    trials : int
        ``N``: training runs with the canary and as many without, >= 4.
    noise_scale, clip_scale : float
        Multipliers (> 0) of the noise std and the clip that the clients use; 1 audits the real
        mechanism.
    canary_norm : float
        ``R`` > 0, the canary's norm (the data's records have norm 1 in ``synthetic_pca``).
    canary_client : int
        The client holding the canary.
    confidence : float
        ``P`` in (0, 1): probability that the reported lower bound holds.
    seed : int or None
        Seeds the trials' noise (reproducible audits); None draws it from OS entropy.
    """

    trials: int = 100
    noise_scale: float = 1.0
    clip_scale: float = 1.0
    canary_norm: float = 1.0
    canary_client: int = 0
    confidence: float = 0.95
    seed: Optional[int] = None

    def validate(self, n_clients: int) -> None:
        """Raise :class:`ConfigError` naming the option for a value outside its range."""
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 4:
            raise ConfigError("--trials", self.trials, "must be an integer >= 4")
        for name in ("noise_scale", "clip_scale", "canary_norm"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError("--" + name.replace("_", "-"), value, "must be a finite number > 0")
        if not 0 <= self.canary_client < n_clients:
            raise ConfigError("--canary-client", self.canary_client, f"must be a client in [0, {n_clients - 1}]")
        if not 0.0 < self.confidence < 1.0:
            raise ConfigError("--confidence", self.confidence, "must be in the open interval (0, 1)")
        if self.seed is not None and self.seed < 0:
            raise ConfigError("--seed", self.seed, "must be an integer >= 0")


class CanaryDataset:
    """``dataset`` with the first record of ``client`` replaced by ``canary`` (``None``: unchanged).

    Implements :class:`rfedray.task.FederatedDataset`; client data is loaded once and cached.
    """

    def __init__(self, dataset: FederatedDataset, client: int, canary: Optional[torch.Tensor]):
        self.dataset, self.client, self.canary = dataset, client, canary
        self.num_clients, self.info = dataset.num_clients, dataset.info
        self._cache: dict[int, ClientData] = {}

    def client_data(self, client_id: int) -> ClientData:
        if client_id not in self._cache:
            data = self.dataset.client_data(client_id)
            if client_id == self.client and self.canary is not None:
                records = data.train[0].clone()
                records[0] = self.canary.to(records.dtype)
                data = ClientData((records, *data.train[1:]), data.test)
            self._cache[client_id] = data
        return self._cache[client_id]

    def client_sizes(self) -> list[int]:
        return self.dataset.client_sizes()

    def eval_data(self):
        return self.dataset.eval_data()


def canary_direction(covariance: torch.Tensor, start: torch.Tensor, p: int) -> torch.Tensor:
    """A unit direction orthogonal to the top-p eigenspace of ``covariance`` on which the projector
    ``start`` has energy 1/2, or as close to 1/2 as such directions allow.

    The canary ``z* = R u`` has the (ambient) gradient ``-R^2 u u^T``, whose tangent part at ``P``
    has norm ``R^2 sqrt(2 e (1 - e))`` with ``e = u^T P u``: largest at ``e = 1/2``, and zero when
    the model holds ``u`` entirely or not at all. Orthogonality keeps the honest records from
    pulling the model towards ``u``.

    Parameters
    ----------
    covariance : Tensor, shape (d, d)
        The data's (pooled) covariance.
    start : Tensor, shape (d, d)
        The starting model's projector.
    p : int
        The subspace dimension, in [1, d - 1].

    Returns
    -------
    Tensor, shape (d,), float64
    """
    _, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    complement = vectors[:, : covariance.shape[0] - p]
    energies, inner = torch.linalg.eigh(complement.T @ start.to(torch.float64) @ complement)
    low, high = float(energies[0]), float(energies[-1])
    share = min(max((0.5 - low) / (high - low), 0.0), 1.0) if high > low else 1.0
    mixed = math.sqrt(share) * inner[:, -1] + math.sqrt(1.0 - share) * inner[:, 0]
    return complement @ mixed


def clopper_pearson_upper(failures: int, trials: int, tail: float) -> float:
    """Upper end of the one-sided Clopper-Pearson interval of a rate, at level ``1 - tail``."""
    if failures >= trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - tail, failures + 1, trials - failures))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The largest epsilon that rates ``(FPR, FNR)`` force on an ``(epsilon, delta)``-DP mechanism (>= 0)."""
    bounds = [0.0]
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if 1.0 - delta - b > 0:
            bounds.append(math.inf if a <= 0 else math.log((1.0 - delta - b) / a))
    return max(bounds)


def threshold_test(null: np.ndarray, alt: np.ndarray, threshold: float) -> tuple[int, int]:
    """False positives (null scores above ``threshold``) and false negatives (alternative ones not)."""
    return int((null > threshold).sum()), int((alt <= threshold).sum())


def epsilon_lower_bound(null: np.ndarray, alt: np.ndarray, threshold: float, delta: float, confidence: float) -> dict:
    """The epsilon lower bound (holding with probability ``confidence``) of one threshold test."""
    tail = (1.0 - confidence) / 2
    fp, fn = threshold_test(null, alt, threshold)
    fpr_upper = clopper_pearson_upper(fp, null.size, tail)
    fnr_upper = clopper_pearson_upper(fn, alt.size, tail)
    return {
        "threshold": float(threshold), "fpr": fp / null.size, "fnr": fn / alt.size,
        "fpr_upper": fpr_upper, "fnr_upper": fnr_upper,
        "epsilon_lower": epsilon_from_rates(fpr_upper, fnr_upper, delta),
        "epsilon_point": epsilon_from_rates(fp / null.size, fn / alt.size, delta),
    }


def best_threshold(null: np.ndarray, alt: np.ndarray, delta: float, confidence: float) -> float:
    """The threshold whose test gives the largest lower bound on these scores."""
    values = np.unique(np.concatenate([null, alt]))
    candidates = [values[0] - 1.0, *((values[1:] + values[:-1]) / 2), values[-1] + 1.0]
    return max(candidates, key=lambda t: epsilon_lower_bound(null, alt, t, delta, confidence)["epsilon_lower"])


class Auditor:
    """The audit of one configuration: the claim, the canary, the trials and the bound.

    Parameters
    ----------
    cfg : Config
        A private federated-PCA configuration (``model.name: fedpca``).
    plan : AuditPlan

    Raises
    ------
    ConfigError
        For a model other than fedpca, a non-private configuration or an audit option out of range.
    """

    def __init__(self, cfg: Config, plan: AuditPlan):
        if cfg.model.name != "fedpca":
            raise ConfigError("model.name", cfg.model.name, "the audit measures federated PCA: use model.name=fedpca")
        if not cfg.privacy.enabled:
            raise ConfigError("privacy.enabled", False, "the audit measures a private run: set privacy.enabled=true")
        plan.validate(cfg.federation.n_clients)
        self.cfg, self.plan = cfg, plan
        self.fed = Federation.prepare(cfg, run_dir=None)
        self.model = self.fed.model
        self.rounds, self.epsilon_claimed, self.epsilon_transcript = self._claim()
        self.start = initial_params(cfg, self.model)
        (covariance,) = self.fed.dataset.eval_data().tensors[:1]
        projector = self.model.parametrisation.projector(self.start[GROUP])
        self.direction = canary_direction(covariance, projector, self.model.p)
        self.canary = plan.canary_norm * self.direction
        privacy = self.fed.privacy
        used = dataclasses.replace(privacy.mechanism, sigma=privacy.sigma * plan.noise_scale,
                                   clip=privacy.mechanism.clip * plan.clip_scale)
        self.local_plan = dataclasses.replace(local_plan(cfg, privacy), mechanism=used)

    def _claim(self) -> tuple[int, float, float]:
        """Rounds the run trains before the ledger halts it, the canary client's epsilon, the transcript's."""
        ledger = self.fed.make_ledger()
        fed_cfg = self.cfg.federation
        rounds = 0
        for t in range(self.cfg.run.rounds):
            if not ledger.authorize(cohort(self.cfg.run.seed, t, fed_cfg.n_clients, fed_cfg.clients_per_round)).granted:
                break
            rounds += 1
        return rounds, ledger.client_epsilon(self.plan.canary_client), ledger.epsilon_spent()

    def noise_seed(self, trial: int) -> Optional[int]:
        if self.plan.seed is None:
            return None
        return int.from_bytes(np.random.SeedSequence(self.plan.seed, spawn_key=(trial,)).generate_state(4).tobytes(), "little")

    def train(self, dataset: FederatedDataset, noise_seed: Optional[int]) -> Params:
        """One private training run of ``self.rounds`` rounds on ``dataset``; the final model."""
        cfg, fed_cfg = self.cfg, self.cfg.federation
        plan = dataclasses.replace(self.local_plan, noise_seed=noise_seed)
        executor = LocalExecutor(cfg, dataset, self.model, plan)
        weights = self.fed.sizes if cfg.aggregation.weighting == "data_size" else None
        server = Server(self.fed.product, build_scheme(cfg), weights)
        theta, states = dict(self.start), {}
        for t in range(self.rounds):
            chosen = cohort(cfg.run.seed, t, fed_cfg.n_clients, fed_cfg.clients_per_round)
            answered = {c: r for c, r in executor.train(chosen, theta, t, states).items() if isinstance(r, LocalResult)}
            theta, _ = server.aggregate(theta, {c: r.submission for c, r in answered.items()})
            states.update({c: r.optimizer_state for c, r in answered.items()})
        return theta

    def score(self, theta: Params) -> float:
        """``u^T P u``: the trained model's projection energy on the canary direction."""
        projector = self.model.parametrisation.projector(theta[GROUP].to(torch.float64))
        return float(self.direction @ projector @ self.direction)

    def run(self) -> dict:
        """Train every trial and return the report (see the module docstring)."""
        started = time.perf_counter()
        datasets = {
            False: CanaryDataset(self.fed.dataset, self.plan.canary_client, None),
            True: CanaryDataset(self.fed.dataset, self.plan.canary_client, self.canary),
        }
        scores: dict[bool, list[float]] = {False: [], True: []}
        for trial in range(2 * self.plan.trials):
            with_canary = trial % 2 == 0
            scores[with_canary].append(self.score(self.train(datasets[with_canary], self.noise_seed(trial))))
        null, alt = np.asarray(scores[False]), np.asarray(scores[True])
        half = self.plan.trials // 2
        delta, confidence = self.fed.privacy.delta, self.plan.confidence
        threshold = best_threshold(null[:half], alt[:half], delta, confidence)
        test = epsilon_lower_bound(null[half:], alt[half:], threshold, delta, confidence)
        privacy = self.fed.privacy
        return {
            **test,
            "epsilon_claimed": self.epsilon_claimed, "epsilon_transcript": self.epsilon_transcript,
            "violated": test["epsilon_lower"] > self.epsilon_claimed,
            "delta": delta, "confidence": confidence, "trials": self.plan.trials,
            "calibration_trials": half, "test_trials": self.plan.trials - half, "rounds": self.rounds,
            "sigma_claimed": privacy.sigma, "sigma_used": self.local_plan.mechanism.sigma,
            "clip_claimed": privacy.mechanism.clip, "clip_used": self.local_plan.mechanism.clip,
            "canary_norm": self.plan.canary_norm, "canary_client": self.plan.canary_client,
            "score_mean_without": float(null.mean()), "score_mean_with": float(alt.mean()),
            "seeded": self.plan.seed is not None, "wall_seconds": time.perf_counter() - started,
        }


def audit(cfg: Config, plan: AuditPlan) -> dict:
    """Run the audit of ``cfg`` (see the module docstring) and return its report."""
    return Auditor(cfg, plan).run()


def describe(report: dict) -> str:
    """One line for people: the bound, the claim and the verdict."""
    point = report["epsilon_point"]
    verdict = ("VIOLATION: the empirical lower bound exceeds the accountant's epsilon"
               if report["violated"] else "consistent with the accountant")
    return (
        f"audit: epsilon >= {report['epsilon_lower']:.3g} with {report['confidence']:.0%} confidence "
        f"(point estimate {point:.3g}; FPR {report['fpr']:.3g}, FNR {report['fnr']:.3g} on "
        f"{report['test_trials']}+{report['test_trials']} held-out trials); the accountant claims epsilon = "
        f"{report['epsilon_claimed']:.3g} at delta = {report['delta']:g} for the canary's client: {verdict}"
    )


def _json_safe(report: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in report.items()}


def cmd_audit(args: argparse.Namespace) -> int:
    """Exit status 0 when the audit is consistent with the accountant, 1 on a violation."""
    from rfedray.config import load_items

    cfg = load_items(args.items, ["run.engine=local"])
    plan = AuditPlan(
        trials=args.trials, noise_scale=args.noise_scale, clip_scale=args.clip_scale, canary_norm=args.canary_norm,
        canary_client=args.canary_client, confidence=args.confidence, seed=args.seed,
    )
    report = audit(cfg, plan)
    print(json.dumps(_json_safe(report), sort_keys=True) if args.json else describe(report))
    return 1 if report["violated"] else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``audit`` command to a CLI's subparsers."""
    parser = subparsers.add_parser(
        "audit", help="empirical privacy audit of private federated PCA (canary membership test)",
        description="Train the configured private federated PCA many times with and without a canary record "
                    "and bound epsilon from below with a Clopper-Pearson interval; exit status 1 when the "
                    "bound exceeds the accountant's epsilon.",
    )
    parser.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                        help="a YAML config and dotlist overrides, as for `rfedray run`")
    parser.add_argument("--trials", type=int, default=100, metavar="N", help="runs with the canary and as many without (>= 4)")
    parser.add_argument("--noise-scale", type=float, default=1.0, metavar="S",
                        help="multiply the noise the clients use (break the mechanism on purpose: 1e-3)")
    parser.add_argument("--clip-scale", type=float, default=1.0, metavar="S",
                        help="multiply the clip the clients use (break the mechanism on purpose: 1e4)")
    parser.add_argument("--canary-norm", type=float, default=1.0, metavar="R", help="norm of the canary record")
    parser.add_argument("--canary-client", type=int, default=0, metavar="I", help="client holding the canary")
    parser.add_argument("--confidence", type=float, default=0.95, metavar="P", help="confidence of the lower bound")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="seed the trials' noise (default: OS entropy)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(func=cmd_audit)

