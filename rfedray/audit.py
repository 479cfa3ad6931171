"""White-box privacy audit: gradient canaries, the whole federation loop, and a Gaussian shift test.

::

    rfedray audit [CONFIG] [key=value ...] [--trials N] [--noise-scale S] [--clip-scale S]
                  [--canary-norm R] [--confidence P] [--seed S] [--json]

Without ``CONFIG`` the audit runs :data:`AUDIT_SETTING` over the defaults: a small federated PCA on
Gr(10, 2), 2 clients taking part in every round, 20 rounds of 5 steps at ``q = B / m = 0.1``,
epsilon 1.

**The canaries.** The auditor is the honest-but-curious server, white-box: it makes ``K`` records
of every client *gradient canaries*. Canary ``k``'s loss is ``s_k <theta, G_k>``: its gradient is
``s_k G_k`` wherever the model is, with a sign ``s_k = +-1`` the auditor draws for every trial
(half of a client's canaries ``+1``). Flipping one sign replaces one record: the replace-one
relation of the accountant. The directions ``G_k`` are orthogonal and tangent at the starting model
``theta_0``, the data's optimum, where the data pull the model back from any displacement (each
turns one of the top eigenvectors towards one of the others); their tangent norm there is ``R C``
(``R >= 1``), so the clip always binds: whenever canary ``k`` is in a minibatch, its clipped
gradient is ``+-C u_k`` with ``u_k`` the unit tangent direction of ``G_k``, the largest difference one
record can make (``2C/B`` in the step's mean, ``mu0 = 2C / (B sigma)`` in units of the noise). The
other records are the configured data.

**The trials.** Each trial runs the library's federation loop
(:meth:`rfedray.federated.loop.Federation.run`: cohorts, the exact accountant's ledger charged
before every round, local training by :class:`~rfedray.federated.executor.LocalExecutor` through
the model's closed-form per-record rule or the generic ``vmap(grad)`` path, the server's defended
aggregation, a run directory). The server keeps every submission; the claim is the ledger's epsilon
of the clients (they take part in every round, so each has the transcript's epsilon).

**The statistic.** A submission stands for a tangent displacement ``Delta_t`` at ``theta_t``
(:func:`rfedray.aggregation.displacement`), ``-eta sum_j g_j`` over the round's steps to first
order. Canary ``k`` of a client has the statistic ``S_k = -sum_t <Delta_t, u_k(theta_t)>`` over the
client's rounds: in units of the noise, each of the ``n`` steps adds ``N(0, 1)`` and ``s_k mu0 / 2``
when the canary is sampled (rate ``q``). So, by the central limit theorem, ``S_k`` given ``s_k = +1``
and given ``s_k = -1`` are Gaussians of equal variance (the f-DP view: the pair is ``G_mu``), shifted
by ``mu_lin(mu0) = sqrt(n) q mu0 / sqrt(1 + q (1 - q) mu0^2 / 4)`` standard deviations. Anything this
linear model leaves out (the data's pull back towards ``theta_0``, the data's gradients along
``u_k``, the curvature, directions that turn with the model, the other canaries) lowers the shift or
adds variance: it can only lower the estimate. Directions are orthogonal, so the noise in one
canary's statistic is independent of another's; the other canaries' signs are independent of
``s_k``, so each statistic tests one replaced record (the mixture over the others is a mixture of
neighbouring pairs).

**The bound.** With balanced signs, a trial's contrast ``c = mean_k(s_k S_k)`` has mean
``Delta / 2``, ``Delta`` the shift of one canary's statistic; trials are independent runs, so a
t interval over the trials' contrasts bounds ``Delta`` from below whatever the dependence between
one trial's canaries. The pooled standard deviation ``s`` of the statistics within a sign group is
bounded from above by a chi-square interval, and ``d_lower = Delta_lower / s_upper`` (the two
intervals share ``1 - P`` as 4:1). Inverting ``mu_lin`` gives the smallest per-step ratio
``mu0_lower`` consistent with the trials, i.e. the largest noise ``sigma_lower = 2 C / (B mu0_lower)``,
and the reported lower bound is the exact accountant's epsilon of the clients' transcript at
``sigma_lower``: with probability at least ``P`` the mechanism is no more private than a subsampled
Gaussian mechanism with that noise. For the correct mechanism ``mu0_lower <= mu0`` (the bound stays
below the claim) with probability at least ``P``; with the noise halved ``mu0`` doubles, and with the
clipping off the canaries' whole norm ``R C`` enters. A bound above the claim is a violation, found
with confidence ``P``. A distribution-free bound is reported beside it (Clopper-Pearson bounds of
the error rates of a threshold on the statistics, chosen on half of them): it needs no model of
``S``, but with thousands of samples it cannot certify more than a few units of epsilon.

``--noise-scale`` and ``--clip-scale`` multiply the noise and the clip the clients actually use,
while the claim stays the accountant's for the configured ones: they break the mechanism on
purpose. Trials draw their noise (and the canaries' signs) from OS entropy unless ``--seed`` is given
(reproducible audits).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from rfedray import aggregation
from rfedray.config import Config, ConfigError
from rfedray.federated.client import LocalResult
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import build_scheme, local_plan
from rfedray.geometry import ProductManifold
from rfedray.models.fedpca import FedPCA
from rfedray.privacy.accountants import ExactAccountant, GaussianStep
from rfedray.task import ClientData, EvalData, Params

AUDIT_SETTING = (
    "run.engine=local", "run.rounds=20", "run.evaluate_every=20", "run.checkpoint_every=20",
    "federation.n_clients=2", "federation.clients_per_round=2", "federation.local_steps=5", "federation.batch_size=10",
    "data.source=synthetic_pca", "data.options.d=10", "data.options.p=2", "data.options.records_per_client=100",
    "data.options.dtype=float64", "model.name=fedpca", "optim.default.lr=0.01", "privacy.epsilon=1.0",
    "monitoring.progress=false",
)
"""What ``rfedray audit`` audits when no CONFIG is given (overrides of the defaults)."""

LOWER_SHARE = 0.8
"""Share of ``1 - P`` given to the lower bound of the shift (the rest bounds the standard deviation)."""


class TrialLedger:
    """The ledger of one audit trial: a trial is never resumed, so its start writes no files;
    every other attribute is the ledger's."""

    def __init__(self, ledger):
        self.ledger = ledger

    def start(self):
        """A new trial: its empty ledger's state (for the checkpoint of round 0), no files."""
        return self.ledger.state_dict()

    def __getattr__(self, name):
        return getattr(self.ledger, name)


@dataclasses.dataclass(frozen=True)
class AuditPlan:
    """How to audit.

    Attributes
    ----------
    trials : int
        Training runs, an even number >= 10 (pairs with opposite canary signs).
    noise_scale, clip_scale : float
        Multipliers (> 0) of the noise std and the clip that the clients use; 1 audits the real
        mechanism.
    canary_norm : float
        ``R >= 1``: a canary gradient's tangent norm at the start, in units of the clip ``C``.
    canaries : int or None
        Canaries per client (an even number >= 2); None: as many orthogonal directions as the
        model offers, at most 16 and at most half a client's records.
    confidence : float
        ``P`` in (0, 1): probability that the reported lower bound holds.
    seed : int or None
        Seeds the trials' noise and the canaries' signs (reproducible audits, in ``[0, 2^128)``);
        None draws them from OS entropy.
    """

    trials: int = 200
    noise_scale: float = 1.0
    clip_scale: float = 1.0
    canary_norm: float = 10.0
    canaries: Optional[int] = None
    confidence: float = 0.95
    seed: Optional[int] = None

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the option for a value outside its range."""
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 10 or self.trials % 2:
            raise ConfigError("--trials", self.trials, "must be an even integer >= 10 (pairs of trials)")
        for name in ("noise_scale", "clip_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError("--" + name.replace("_", "-"), value, "must be a finite number > 0")
        if not (isinstance(self.canary_norm, (int, float)) and math.isfinite(self.canary_norm) and self.canary_norm >= 1):
            raise ConfigError("--canary-norm", self.canary_norm, "must be a finite number >= 1 (a multiple of the clip)")
        if self.canaries is not None and (self.canaries < 2 or self.canaries % 2):
            raise ConfigError("--canaries", self.canaries, "must be an even number >= 2")
        if not 0.0 < self.confidence < 1.0:
            raise ConfigError("--confidence", self.confidence, "must be in the open interval (0, 1)")
        if self.seed is not None and not 0 <= self.seed < 1 << 128:
            raise ConfigError("--seed", self.seed, "must be an integer in [0, 2^128)")

    def _sequence(self, trial: int, purpose: int) -> np.random.SeedSequence:
        return np.random.SeedSequence(self.seed, spawn_key=(purpose, trial))

    def noise_seed(self, trial: int) -> Optional[int]:
        """The noise seed of trial ``trial`` (None: OS entropy)."""
        if self.seed is None:
            return None
        return int.from_bytes(self._sequence(trial, 0).generate_state(4).tobytes(), "little")

    def signs(self, trial: int, clients: int, canaries: int) -> np.ndarray:
        """The canaries' signs of trial ``trial``, shape ``(clients, canaries)``: half of each row +1,
        drawn for each pair of trials ``(2u, 2u + 1)`` and flipped in its second trial."""
        rng = np.random.default_rng(self._sequence(trial // 2, 1))
        row = np.repeat([1.0, -1.0], canaries // 2)
        pattern = np.stack([rng.permutation(row) for _ in range(clients)])
        return pattern if trial % 2 == 0 else -pattern


# ----- the canaries -------------------------------------------------------------------------------

def _inner(product: ProductManifold, a: Params, b: Params) -> Tensor:
    """``sum_g <a_g, b_g>`` over each group's own dimensions; leading dimensions broadcast."""
    return sum((a[g] * b[g]).flatten(-len(m.shape)).sum(-1) for g, m in product.groups.items())


class Canaries:
    """``K`` canary gradients: ambient directions ``G_k``, ``{group: (K, *shape_g)}``.

    A record carries its canary coefficients ``c`` (shape ``(K,)``) as its last field: zero for the
    data, ``s e_k`` for canary ``k``; its canary gradient is ``sum_k c_k G_k``.
    """

    def __init__(self, product: ProductManifold, directions: Params):
        self.product, self.directions = product, directions
        self.count = int(next(iter(directions.values())).shape[0])

    def gradient(self, coefficients: Tensor) -> Params:
        """``sum_k c_k G_k`` for coefficients of shape ``(..., K)``: ``{g: (..., *shape_g)}``."""
        return {g: torch.tensordot(coefficients, d, dims=1) for g, d in self.directions.items()}

    def unit_tangents(self, theta: Params) -> Params:
        """``u_k = P_theta G_k / ||P_theta G_k||`` at one point ``theta``: ``{g: (K, *shape_g)}``."""
        tangent = self.product.proj_tangent(theta, self.directions)
        norms = self.product.norm(tangent)
        return {g: t / norms.reshape((-1,) + (1,) * (t.dim() - 1)) for g, t in tangent.items()}


class CanaryRule:
    """A model's :class:`~rfedray.privacy.mechanism.PerSampleRule` with canary records: data records
    (zero coefficients) go through the model's rule, canaries through their constant gradients.
    Broadcasts over leading dimensions like the rule it wraps."""

    def __init__(self, rule, canaries: Canaries):
        self.rule, self.canaries = rule, canaries

    def _canary_tangents(self, params: Params, coefficients: Tensor) -> Params:
        """The records' canary gradients projected at ``params``, ``{g: (..., B, *shape_g)}``."""
        ambient = self.canaries.gradient(coefficients)  # {g: (..., B, *shape_g)}
        points = {g: p.unsqueeze(p.dim() - (self.canaries.directions[g].dim() - 1)) for g, p in params.items()}
        return self.canaries.product.proj_tangent(points, ambient)

    def tangent_norms(self, params: Params, records: tuple[Tensor, ...]) -> Tensor:
        *data, coefficients = records
        norms = self.rule.tangent_norms(params, tuple(data))
        is_canary = (coefficients != 0).any(-1)
        if not bool(is_canary.any()):  # the auditor's harness, not the mechanism: skip work it does not need
            return norms
        return torch.where(is_canary, self.canaries.product.norm(self._canary_tangents(params, coefficients)), norms)

    def group_tangent_norms(self, params: Params, records: tuple[Tensor, ...]) -> Params:
        *data, coefficients = records
        norms = self.rule.group_tangent_norms(params, tuple(data))
        is_canary = (coefficients != 0).any(-1)
        if not bool(is_canary.any()):
            return norms
        tangent, groups = self._canary_tangents(params, coefficients), self.canaries.product.groups
        return {g: torch.where(is_canary, groups[g].norm(tangent[g]), norms[g]) for g in norms}

    def weighted_gradient(self, params: Params, records: tuple[Tensor, ...], weights: Tensor) -> Params:
        *data, coefficients = records
        is_canary = (coefficients != 0).any(-1)
        total = self.rule.weighted_gradient(params, tuple(data), torch.where(is_canary, 0.0, weights))
        canary = self.canaries.gradient((weights[..., None] * coefficients).sum(-2))
        return {g: total[g] + canary[g] for g in total}


class GradientCanary:
    """A :class:`~rfedray.task.FederatedModel` whose records carry canary coefficients (last field).

    The loss of a record ``(*z, c)`` is the model's ``f(theta; z)`` when ``c = 0`` and
    ``<theta, sum_k c_k G_k>`` otherwise. The model's closed-form rule, if it has one, is kept
    (:class:`CanaryRule`); else per-record gradients come from ``vmap(grad)`` of this loss. It starts
    at ``start`` and evaluates like the model.
    """

    def __init__(self, model, canaries: Canaries, start: Params):
        self.model, self.canaries, self.start = model, canaries, start
        self.groups = model.groups
        rule = model.gradient_rule
        self.gradient_rule = None if rule is None else CanaryRule(rule, canaries)

    def init_params(self, generator) -> Params:
        return {g: v.clone() for g, v in self.start.items()}

    def per_sample_loss(self, params: Params, *record: Tensor) -> Tensor:
        *data, coefficients = record
        canary = _inner(self.canaries.product, params, self.canaries.gradient(coefficients))
        return torch.where((coefficients != 0).any(), canary, self.model.per_sample_loss(params, *data))

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        return self.model.evaluate(params, data)


class CanaryDataset:
    """The audited federation's data with canary coefficients: the first ``K`` records of client ``i``
    are its canaries, canary ``k`` with coefficients ``signs[i, k] e_k``; the others have zeros.
    Implements :class:`~rfedray.task.FederatedDataset` over client data loaded once (``clients``)."""

    def __init__(self, clients: Mapping[int, ClientData], info: dict, eval_data: EvalData, signs: np.ndarray):
        self.clients, self.info, self._eval, self.signs = clients, info, eval_data, signs
        self.num_clients = len(clients)

    def client_data(self, client_id: int) -> ClientData:
        data = self.clients[client_id]
        count = self.signs.shape[1]
        coefficients = torch.zeros(data.num_records, count, dtype=data.train[0].dtype)
        coefficients[:count] = torch.diag(torch.as_tensor(self.signs[client_id], dtype=coefficients.dtype))
        return ClientData((*data.train, coefficients), data.test)

    def client_sizes(self) -> list[int]:
        return [self.clients[i].num_records for i in range(self.num_clients)]

    def eval_data(self) -> EvalData:
        return self._eval


def canary_geometry(model: FedPCA, covariance: Tensor, norm: float, count: Optional[int]) -> tuple[Params, Params]:
    """The starting point (the data's optimum) and ``K`` orthogonal canary gradients ``G_k``.

    Direction ``(j, l)`` is the tangent part, at the optimum, of the loss gradient of a record half
    on the ``j``-th top eigenvector and half on the ``l``-th other one (the weakest first): it turns
    the subspace towards ``l``, against the data's pull. Each has norm ``norm``.

    Parameters
    ----------
    model : FedPCA
    covariance : Tensor, shape (d, d)
        The pooled covariance of the data (the audit's white-box knowledge).
    norm : float
        ``R C``.
    count : int or None
        ``K``; None: every such direction, at most 16 (even).

    Returns
    -------
    start : dict of Tensor
        ``{group: (*shape_g)}``.
    directions : dict of Tensor
        ``{group: (K, *shape_g)}``, orthogonal in the ambient inner product.
    """
    group, = model.groups
    _, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    d, p = vectors.shape[0], model.p
    start = {group: model.parametrisation.point(vectors[:, d - p:])}
    product = ProductManifold(model.groups)
    pairs = [(j, l) for l in range(d - p) for j in range(d - p, d)]
    available = min(len(pairs), 16) // 2 * 2
    count = available if count is None else count
    ConfigError.check(count <= available, "--canaries", count, f"this model offers {available} orthogonal canary directions")
    directions = []
    for j, l in pairs[:count]:
        record = (vectors[:, j] + vectors[:, l]) / math.sqrt(2.0)
        tangent = product.proj_tangent(start, torch.func.grad(model.per_sample_loss)(start, record))[group]
        directions.append(norm * tangent / torch.linalg.vector_norm(tangent))
    return ({group: start[group].to(model.dtype)}, {group: torch.stack(directions).to(model.dtype)})


class RememberingAccountant:
    """An accountant that remembers every epsilon it computed: the trials' ledgers charge the same
    participations, so each value is computed once for the whole audit."""

    def __init__(self, accountant):
        self.accountant = accountant
        self.name, self.upper_bound = accountant.name, accountant.upper_bound
        self._values: dict[tuple, float] = {}

    def epsilon(self, step, **kwargs) -> float:
        key = (step, *sorted(kwargs.items()))
        if key not in self._values:
            self._values[key] = self.accountant.epsilon(step, **kwargs)
        return self._values[key]

    def config(self) -> dict:
        return self.accountant.config()


class SubmissionLog:
    """The executor of a trial, keeping what the server sees: theta_t and every client's submission."""

    def __init__(self, executor: LocalExecutor):
        self.executor = executor
        self.rounds: list[tuple[Params, dict[int, Params]]] = []

    def train(self, cohort, theta, round_index, states):
        results = self.executor.train(cohort, theta, round_index, states)
        self.rounds.append((theta, {c: r.submission for c, r in results.items() if isinstance(r, LocalResult)}))
        return results

    def close(self) -> None:
        self.executor.close()


# ----- the statistics -------------------------------------------------------------------------------

def linear_shift(mu0: float, steps: int, sampling_rate: float) -> float:
    """``mu_lin``: the standardised shift of a canary's statistic for a per-step ratio ``mu0``,
    ``sqrt(n) q mu0 / sqrt(1 + q (1 - q) mu0^2 / 4)`` (see the module docstring); increasing in ``mu0``."""
    q = sampling_rate
    return math.sqrt(steps) * q * mu0 / math.sqrt(1.0 + q * (1.0 - q) * mu0 * mu0 / 4.0)


def ratio_from_shift(shift: float, steps: int, sampling_rate: float) -> float:
    """The per-step ratio ``mu0`` whose :func:`linear_shift` is ``shift`` (0 for ``shift <= 0``, inf
    beyond the largest shift the statistic can show)."""
    if shift <= 0:
        return 0.0
    room = steps * sampling_rate ** 2 - sampling_rate * (1.0 - sampling_rate) / 4.0 * shift * shift
    return shift / math.sqrt(room) if room > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class ShiftEstimate:
    """The standardised shift ``d = Delta / s`` of a canary's statistic and its lower confidence bound.

    Trials come in pairs ``(2u, 2u + 1)`` whose canaries have opposite signs, so in a pair's
    differences ``D_k = S_k(2u) - S_k(2u + 1)`` whatever a canary's statistic owes to its place
    (its direction, its client's data) cancels: ``s_k D_k`` has mean ``Delta`` and variance ``2 s^2``.
    Per pair, ``c_u = mean_k(s_k D_k)`` and ``v_u``, the canaries' variance of ``s_k D_k`` over 2, are
    averages over one pair of independent runs: a t interval over the pairs bounds ``Delta`` from below
    (level ``1 - LOWER_SHARE (1 - P)``) and ``s^2`` from above (the rest), whatever the dependence
    between one run's canaries.

    Attributes
    ----------
    shift, lower : float
        ``d`` and ``d_lower = Delta_lower / s_upper``.
    samples, pairs : int
    """

    shift: float
    lower: float
    samples: int
    pairs: int

    @classmethod
    def of(cls, statistics: np.ndarray, signs: np.ndarray, confidence: float) -> "ShiftEstimate":
        """From the canaries' statistics and signs, both ``(trials, canaries)``, trials in pairs."""
        signed = signs[0::2] * (statistics[0::2] - statistics[1::2])  # (pairs, canaries)
        pairs, canaries = signed.shape
        contrasts = signed.mean(axis=1)
        variances = signed.var(axis=1, ddof=1) / 2.0
        tail = 1.0 - confidence
        from scipy import stats  # here: `rfedray run` loads this module with its subcommand, not scipy.stats

        t_lower = float(stats.t.ppf(1.0 - LOWER_SHARE * tail, pairs - 1))
        t_upper = float(stats.t.ppf(1.0 - (1.0 - LOWER_SHARE) * tail, pairs - 1))
        delta, delta_lower = contrasts.mean(), contrasts.mean() - t_lower * contrasts.std(ddof=1) / math.sqrt(pairs)
        variance = variances.mean()
        variance_upper = variance + t_upper * variances.std(ddof=1) / math.sqrt(pairs)
        return cls(float(delta / math.sqrt(variance)), float(delta_lower / math.sqrt(variance_upper)),
                   statistics.size, pairs)


@dataclasses.dataclass(frozen=True)
class Transcript:
    """A client's public accounting parameters, as the ledger charged them."""

    participations: int
    local_steps: int
    batch_size: int
    records: int
    clip: float
    delta: float

    @property
    def steps(self) -> int:
        return self.participations * self.local_steps

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.records

    def epsilon(self, mu0: float) -> float:
        """The exact accountant's epsilon of these steps with per-step ratio ``mu0 = 2C / (B sigma)``."""
        if mu0 <= 0:
            return 0.0
        if not math.isfinite(mu0):
            return math.inf
        sigma = 2.0 * self.clip / (self.batch_size * mu0)
        step = GaussianStep.clipped_mean(sigma=sigma, clip=self.clip, batch_size=self.batch_size, records=self.records)
        return ExactAccountant().epsilon(step, rounds=self.participations, local_steps=self.local_steps, delta=self.delta)


def clopper_pearson_upper(failures: int, trials: int, tail: float) -> float:
    """Upper end of the one-sided Clopper-Pearson interval of a rate, at level ``1 - tail``."""
    if failures >= trials:
        return 1.0
    from scipy import stats

    return float(stats.beta.ppf(1.0 - tail, failures + 1, trials - failures))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The largest epsilon that rates ``(FPR, FNR)`` force on an ``(epsilon, delta)``-DP mechanism (>= 0)."""
    bounds = [0.0]
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if 1.0 - delta - b > 0:
            bounds.append(math.inf if a <= 0 else math.log((1.0 - delta - b) / a))
    return max(bounds)


def threshold_bound(null: np.ndarray, alt: np.ndarray, threshold: float, delta: float, confidence: float) -> float:
    """The distribution-free epsilon lower bound of the test "alt if the statistic exceeds ``threshold``"."""
    tail = (1.0 - confidence) / 2
    fp, fn = int((null > threshold).sum()), int((alt <= threshold).sum())
    return epsilon_from_rates(clopper_pearson_upper(fp, null.size, tail), clopper_pearson_upper(fn, alt.size, tail), delta)


def distribution_free_bound(null: np.ndarray, alt: np.ndarray, delta: float, confidence: float) -> float:
    """A threshold chosen on the first half of the samples (among 200 quantiles), tested on the second."""
    half = min(null.size, alt.size) // 2
    candidates = np.quantile(np.concatenate([null[:half], alt[:half]]), np.linspace(0, 1, 201))
    best = max(candidates, key=lambda t: threshold_bound(null[:half], alt[:half], t, delta, confidence))
    return threshold_bound(null[half:], alt[half:], best, delta, confidence)


# ----- the audit ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _scratch_directory():
    """A directory for the trials' run directories (in memory where the system has /dev/shm)."""
    try:
        base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 256 * 2**20 else None
    except OSError:
        base = None
    with tempfile.TemporaryDirectory(prefix="rfedray-audit-", dir=base) as path:
        yield path


class Auditor:
    """The audit of one configuration: the canaries, the trials through the federation loop, the bound.

    Parameters
    ----------
    cfg : Config
        A private federated-PCA configuration (``model.name: fedpca``) whose clients all take part
        in every round (``federation.clients_per_round = federation.n_clients``). Its trials are
        evaluated by the server (``run.test_set: server``, whatever the configuration says).
    plan : AuditPlan

    Raises
    ------
    ConfigError
        For another model, a non-private configuration, partial participation, clients too small
        for their canaries, or an audit option out of range.
    """

    def __init__(self, cfg: Config, plan: AuditPlan):
        if cfg.model.name != "fedpca":
            raise ConfigError("model.name", cfg.model.name, "the audit measures federated PCA: use model.name=fedpca")
        if not cfg.privacy.enabled:
            raise ConfigError("privacy.enabled", False, "the audit measures a private run: set privacy.enabled=true")
        fed_cfg = cfg.federation
        if fed_cfg.clients_per_round != fed_cfg.n_clients:
            raise ConfigError("federation.clients_per_round", fed_cfg.clients_per_round,
                              f"the audit's clients take part in every round: set it to federation.n_clients ({fed_cfg.n_clients})")
        plan.validate()
        # The trials' evaluation is the server's (federated PCA's oracle, run.test_set=server): the audit
        # measures the submissions only, so its trials need no secure aggregation of test results.
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, test_set="server"))
        self.cfg, self.plan = cfg, plan
        self.fed = Federation.prepare(cfg, run_dir=None)
        privacy = self.fed.privacy
        eval_data = self.fed.dataset.eval_data()
        start, directions = canary_geometry(self.fed.model, eval_data.tensors[0], plan.canary_norm * privacy.clip,
                                            plan.canaries)
        self.product = ProductManifold(self.fed.model.groups)
        self.canaries = Canaries(self.product, directions)
        smallest = min(self.fed.sizes)
        if 2 * self.canaries.count > smallest:
            raise ConfigError("--canaries", self.canaries.count, f"must be at most half a client's records ({smallest})")
        self.model = GradientCanary(self.fed.model, self.canaries, start)
        self.scheme = build_scheme(cfg)
        self.clients = {i: self.fed.dataset.client_data(i) for i in range(fed_cfg.n_clients)}
        self.eval_data = eval_data
        self.accountant = RememberingAccountant(self.fed.make_ledger().accountant)
        used = dataclasses.replace(privacy.mechanism, sigma=privacy.sigma * plan.noise_scale,
                                   clip=privacy.clip * plan.clip_scale)
        self.local_plan = dataclasses.replace(local_plan(cfg, privacy), mechanism=used)

    def trial(self, index: int, signs: np.ndarray, workdir: str):
        """One federation with the canaries' ``signs`` ``(clients, K)``: the canaries' statistics
        ``(clients, K)`` and the trial's ledger."""
        dataset = CanaryDataset(self.clients, self.fed.dataset.info, self.eval_data, signs)
        ledgers = []

        def make_ledger():
            ledger = self.fed.make_ledger()
            ledger.accountant = self.accountant
            ledgers.append(ledger)
            return TrialLedger(ledger)

        run_dir = RunDirectory.create(workdir, f"trial-{index}")
        fed = dataclasses.replace(self.fed, run_dir=run_dir, model=self.model, dataset=dataset, observers=[],
                                  ledger_factory=make_ledger)
        plan = dataclasses.replace(self.local_plan, noise_seed=self.plan.noise_seed(index))
        log = SubmissionLog(LocalExecutor(self.cfg, dataset, self.model, plan))
        try:
            fed.run(log)
        finally:
            log.close()
            shutil.rmtree(run_dir.path, ignore_errors=True)
        return self.statistics(log.rounds, signs.shape[0]), ledgers[0]

    def statistics(self, rounds: Sequence[tuple[Params, Mapping[int, Params]]], clients: int) -> np.ndarray:
        """``S_k = -sum_t <Delta_t, u_k(theta_t)>`` of every client's canaries, shape ``(clients, K)``."""
        totals = torch.zeros(clients, self.canaries.count, dtype=torch.float64)
        for theta, submissions in rounds:
            units = self.canaries.unit_tangents(theta)
            for client, submission in submissions.items():
                moved = aggregation.displacement(self.scheme, self.product, theta, submission)
                totals[client] -= _inner(self.product, units, moved).to(torch.float64)
        return totals.numpy()

    def run(self, progress: Optional[Callable[[int, int, float], None]] = None) -> dict:
        """Train every trial and return the report (see the module docstring)."""
        from rfedray.threads import use_threads

        fed_cfg, privacy = self.cfg.federation, self.fed.privacy
        clip = privacy.clip
        use_threads(self.fed.threads())
        started = time.perf_counter()
        statistics, signs = [], []
        with _scratch_directory() as workdir:
            for index in range(self.plan.trials):
                trial_signs = self.plan.signs(index, fed_cfg.n_clients, self.canaries.count)
                values, ledger = self.trial(index, trial_signs, workdir)
                statistics.append(values.ravel())
                signs.append(trial_signs.ravel())
                if progress is not None:
                    progress(index + 1, self.plan.trials, time.perf_counter() - started)
        statistics, signs = np.asarray(statistics), np.asarray(signs)
        smallest = int(np.argmin(self.fed.sizes))
        transcript = Transcript(ledger.participations(smallest), fed_cfg.local_steps, fed_cfg.batch_size,
                                self.fed.sizes[smallest], clip, privacy.delta)
        estimate = ShiftEstimate.of(statistics, signs, self.plan.confidence)
        mu0_lower = ratio_from_shift(estimate.lower, transcript.steps, transcript.sampling_rate)
        mu0_claimed = 2.0 * clip / (fed_cfg.batch_size * privacy.sigma)
        claimed = ledger.client_epsilon(smallest)
        lower = transcript.epsilon(mu0_lower)
        return {
            "epsilon_lower": lower, "epsilon_claimed": claimed, "violated": lower > claimed,
            "epsilon_lower_distribution_free": distribution_free_bound(
                statistics[signs < 0], statistics[signs > 0], privacy.delta, self.plan.confidence),
            "delta": privacy.delta, "confidence": self.plan.confidence, "trials": self.plan.trials,
            "canaries": self.canaries.count * fed_cfg.n_clients, "samples": estimate.samples,
            "participations": transcript.participations, "steps": transcript.steps,
            "sampling_rate": transcript.sampling_rate, "shift": estimate.shift, "shift_lower": estimate.lower,
            "shift_expected": linear_shift(mu0_claimed, transcript.steps, transcript.sampling_rate),
            "mu0_claimed": mu0_claimed, "mu0_lower": mu0_lower,
            "sigma_claimed": privacy.sigma, "sigma_used": self.local_plan.mechanism.sigma,
            "sigma_lower": 2.0 * clip / (fed_cfg.batch_size * mu0_lower) if mu0_lower > 0 else math.inf,
            "clip_claimed": clip, "clip_used": self.local_plan.mechanism.clip, "canary_norm": self.plan.canary_norm,
            "manifold": type(next(iter(self.product.groups.values()))).__name__,
            "gradient_path": "closed-form rule" if self.model.gradient_rule is not None else "vmap(grad)",
            "seeded": self.plan.seed is not None, "wall_seconds": time.perf_counter() - started,
        }


def audit(cfg: Config, plan: AuditPlan, progress: Optional[Callable[[int, int, float], None]] = None) -> dict:
    """Run the audit of ``cfg`` (see the module docstring) and return its report."""
    return Auditor(cfg, plan).run(progress)


def describe(report: dict) -> str:
    """One line for people: the bound beside the claim, and the verdict."""
    verdict = ("VIOLATION: the lower bound exceeds the accountant's epsilon"
               if report["violated"] else "consistent with the accountant")
    return (
        f"audit: epsilon >= {report['epsilon_lower']:.3g} with {report['confidence']:.0%} confidence; the accountant "
        f"claims {report['epsilon_claimed']:.3g} (delta {report['delta']:g}). {report['trials']} trials x "
        f"{report['canaries']} canaries, shift {report['shift']:.3g} sd (>= {report['shift_lower']:.3g}; the claimed "
        f"mechanism's {report['shift_expected']:.3g}), {report['wall_seconds']:.0f} s; distribution-free bound "
        f"{report['epsilon_lower_distribution_free']:.3g}: {verdict}"
    )


def _json_safe(report: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in report.items()}


def _progress_line(done: int, total: int, seconds: float) -> None:
    if done == total or done % max(total // 10, 1) == 0:
        left = seconds / done * (total - done)
        print(f"audit: {done}/{total} trials, {seconds:.0f} s, about {left:.0f} s left", file=sys.stderr, flush=True)


def cmd_audit(args: argparse.Namespace) -> int:
    """Exit status 0 when the audit is consistent with the accountant, 1 on a violation."""
    from rfedray.config import load_items, split_items

    path, _ = split_items(args.items)
    cfg = load_items(args.items, ["run.engine=local"]) if path is not None else load_items([*AUDIT_SETTING, *args.items])
    plan = AuditPlan(trials=args.trials, noise_scale=args.noise_scale, clip_scale=args.clip_scale,
                     canary_norm=args.canary_norm, canaries=args.canaries, confidence=args.confidence, seed=args.seed)
    report = audit(cfg, plan, None if args.json else _progress_line)
    print(json.dumps(_json_safe(report), sort_keys=True) if args.json else describe(report))
    return 1 if report["violated"] else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``audit`` command to a CLI's subparsers."""
    parser = subparsers.add_parser(
        "audit", help="white-box privacy audit of private federated PCA (gradient canaries, Gaussian shift test)",
        description="Train the configured private federated PCA many times with gradient canaries pushing one way "
                    "or the other, through the whole federation loop and its ledger, and bound epsilon from below "
                    "from the shift of the canaries' statistics; exit status 1 when the bound exceeds the "
                    "accountant's epsilon. Without CONFIG: a small federated PCA at epsilon 1.",
    )
    parser.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                        help="a YAML config and dotlist overrides, as for `rfedray run` (without CONFIG: overrides "
                             "of the audit's own small setting)")
    parser.add_argument("--trials", type=int, default=200, metavar="N", help="training runs (even, >= 10)")
    parser.add_argument("--noise-scale", type=float, default=1.0, metavar="S",
                        help="multiply the noise the clients use (break the mechanism on purpose: 0.5)")
    parser.add_argument("--clip-scale", type=float, default=1.0, metavar="S",
                        help="multiply the clip the clients use (clipping off: 1e4)")
    parser.add_argument("--canary-norm", type=float, default=10.0, metavar="R",
                        help="a canary gradient's norm in units of the clip (>= 1)")
    parser.add_argument("--canaries", type=int, default=None, metavar="K",
                        help="canaries per client (even; default: every orthogonal direction, at most 16)")
    parser.add_argument("--confidence", type=float, default=0.95, metavar="P", help="confidence of the lower bound")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed the trials' noise and signs (default: OS entropy)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(func=cmd_audit)
