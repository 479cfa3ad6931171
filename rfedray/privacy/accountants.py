"""Privacy accountants: one client's epsilon after ``rounds`` participations of ``local_steps`` steps.

An accountant reads a *step description*, never the mechanism's code or data: what one private
step of a client is, as a pair of adjacent output distributions.

* :class:`GaussianStep`: the subsampled Gaussian mechanism ``C_q(G_mu)``, ``mu`` the sensitivity of
  the released mean over its noise's standard deviation (``mu = 2C / (B sigma)`` for a mean of ``B``
  records clipped to ``C`` with noise ``sigma``) and ``q = B / m`` the sampling rate;
* :class:`LaplaceStep`: the subsampled Laplace mechanism ``C_q(f_r)``, ``r`` the L1 sensitivity over
  the Laplace scale (DDP-SA's step).

The accountants:

* :class:`ExactAccountant`, the guarantee of DP-RFedProj: the composition of the
  ``rounds * local_steps`` Gaussian steps, computed on a discretised privacy-loss distribution.
* :class:`LaplaceAccountant`: the same composition of Laplace steps.
* :class:`CLTAccountant`, the central-limit approximation ``mu_tot`` of the Gaussian composition
  (Dong, Roth and Su), for reading budgets: about ``2 C sqrt(rounds * local_steps) / (m sigma)``.
  It is not an upper bound (it can report a quarter of the exact epsilon), so nothing that spends
  budget accepts it: :class:`~rfedray.privacy.ledger.PrivacyLedger` and :func:`calibrate_sigma`
  refuse it (:func:`require_upper_bound`).
* :class:`PriRFedAccountant`, the round-level accounting of PriRFed (the paper's baseline), for
  comparison only.

:func:`calibrate_noise` finds the smallest noise level meeting a budget under any of them
(:func:`calibrate_sigma` for the Gaussian step of a clipped mean);
:class:`~rfedray.privacy.ledger.PrivacyLedger` charges clients round by round.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import astuple, dataclass
from typing import Callable, ClassVar, Union

from rfedray.privacy import checks
from rfedray.privacy.gdp import gdp_epsilon, gdp_mu
from rfedray.privacy.pld import DiscretePLD, subsampled_gaussian_pld, subsampled_laplace_pld


@dataclass(frozen=True)
class GaussianStep:
    """One private step as the subsampled Gaussian mechanism ``C_q(G_mu)`` (replace-one adjacency).

    Parameters
    ----------
    mu : float
        Sensitivity of the released value over the standard deviation of its Gaussian noise, > 0.
    sampling_rate : float
        ``q = B / m`` in (0, 1]: the batch is ``B`` records drawn without replacement from ``m``.
    """

    mu: float
    sampling_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "mu", checks.positive("mu", self.mu))
        object.__setattr__(self, "sampling_rate", checks.sampling_rate("sampling_rate", self.sampling_rate))

    @classmethod
    def clipped_mean(cls, *, sigma: float, clip: float, batch_size: int, records: int) -> "GaussianStep":
        """The step that releases the mean of ``B`` records' values clipped to norm ``C``, plus
        ``N(0, sigma^2 I)``: replacing one record moves the mean by at most ``2C / B``, so
        ``mu = 2 C / (B sigma)``, and ``q = B / m``.

        Parameters
        ----------
        sigma, clip : float
            Absolute noise standard deviation and clip, both > 0.
        batch_size, records : int
            ``B`` and ``m`` with ``1 <= B <= m``.
        """
        sigma = checks.positive("sigma", sigma)
        clip = checks.positive("clip", clip)
        batch, records = checks.batch_within(batch_size, records)
        return cls(2.0 * clip / (batch * sigma), batch / records)


@dataclass(frozen=True)
class LaplaceStep:
    """One private step as the subsampled Laplace mechanism ``C_q(f_r)`` (replace-one adjacency).

    Parameters
    ----------
    ratio : float
        ``r``: L1 sensitivity of the released values over their Laplace scale, > 0 (see
        :func:`rfedray.privacy.pld.subsampled_laplace_pld`).
    sampling_rate : float
        ``q = B / m`` in (0, 1].
    """

    ratio: float
    sampling_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", checks.positive("ratio", self.ratio))
        object.__setattr__(self, "sampling_rate", checks.sampling_rate("sampling_rate", self.sampling_rate))


Step = Union[GaussianStep, LaplaceStep]


class Accountant(ABC):
    """Maps a step description and a number of steps to ``(epsilon, delta)``-DP for one client.

    Subclasses set :attr:`step_type` (the steps they account) and implement :meth:`_epsilon`;
    :meth:`epsilon` validates the arguments. Every accountant is non-increasing in the noise (in
    ``1 / mu``) and in the client's records (in ``1 / q``) and non-decreasing in ``rounds`` and
    ``local_steps`` (the ledger and the calibration rely on it).
    """

    name: ClassVar[str]
    step_type: ClassVar[type] = GaussianStep
    upper_bound: ClassVar[bool] = True
    """Whether the epsilon it reports is a guarantee (an upper bound on the true epsilon), not an estimate."""

    def epsilon(self, step: Step, *, rounds: int, local_steps: int, delta: float) -> float:
        """Epsilon of one client after ``rounds`` participations of ``local_steps`` steps each.

        Parameters
        ----------
        step : GaussianStep or LaplaceStep
            Every step of the client (of this accountant's :attr:`step_type`).
        rounds, local_steps : int
            >= 0; no step spends nothing (epsilon 0).
        delta : float
            In (0, 1).

        Returns
        -------
        float
            Epsilon at ``delta`` (``inf`` if no finite epsilon reaches it).
        """
        if not isinstance(step, self.step_type):
            raise checks.PrivacyParameterError(
                "step", step, f"the {self.name} accountant accounts a {self.step_type.__name__}")
        rounds = checks.nonnegative_int("rounds", rounds)
        local_steps = checks.nonnegative_int("local_steps", local_steps)
        delta = checks.open_unit("delta", delta)
        if rounds == 0 or local_steps == 0:
            return 0.0
        return self._epsilon(step, rounds, local_steps, delta)

    @abstractmethod
    def _epsilon(self, step: Step, rounds: int, local_steps: int, delta: float) -> float:
        """Epsilon for validated arguments with ``rounds, local_steps >= 1``."""

    def config(self) -> dict:
        """The accountant's name and settings (JSON-serialisable; a ledger's state records it)."""
        return {"name": self.name}


class PLDAccountant(Accountant):
    """Exact (discretised) composition of identical subsampled steps through their PLD.

    Subclasses say which step: :meth:`build_step_pld` returns the PLD of one step (its description's
    fields: ``mu`` or ``ratio``, then the sampling rate ``q``) on a grid of step ``discretization``.

    Parameters
    ----------
    discretization : float
        Grid step of the privacy losses, > 0. The error on epsilon is of second order in it and
        always an over-estimate.

    Notes
    -----
    One step's PLD is built once per step description (a few are kept), and its Fourier transform is
    cached inside it, so evaluating more participations of the same client costs one inverse FFT
    (see :mod:`rfedray.privacy.pld`).
    """

    _CACHE_SIZE = 8

    def __init__(self, discretization: float = 1e-4):
        self.discretization = checks.positive("discretization", discretization)
        self._plds: OrderedDict[tuple, DiscretePLD] = OrderedDict()

    @staticmethod
    def build_step_pld(ratio: float, sampling_rate: float, discretization: float) -> DiscretePLD:
        raise NotImplementedError

    def step_pld(self, step: Step) -> DiscretePLD:
        """The discretised PLD of one step (cached per step description)."""
        key = astuple(step)
        if key in self._plds:
            self._plds.move_to_end(key)
        else:
            self._plds[key] = self.build_step_pld(*key, self.discretization)
            if len(self._plds) > self._CACHE_SIZE:
                self._plds.popitem(last=False)
        return self._plds[key]

    def _epsilon(self, step: Step, rounds: int, local_steps: int, delta: float) -> float:
        return self.step_pld(step).self_compose(rounds * local_steps).epsilon(delta)

    def config(self) -> dict:
        return {"name": self.name, "discretization": self.discretization}


class ExactAccountant(PLDAccountant):
    """The symmetrised composition of ``C_q(G_mu)`` over ``rounds * local_steps`` steps.

    At the default discretization 1e-4 the over-estimate of epsilon is below 5e-5 on the paper's
    2,000-step transcripts (epsilon 0.5 to 10).
    """

    name = "exact"
    build_step_pld = staticmethod(subsampled_gaussian_pld)


class LaplaceAccountant(PLDAccountant):
    """Exact (discretised) composition of subsampled Laplace steps (:class:`LaplaceStep`), the
    accountant of DDP-SA (its ``discretization`` as :class:`PLDAccountant`'s)."""

    name = "laplace"
    step_type = LaplaceStep
    build_step_pld = staticmethod(subsampled_laplace_pld)


class CLTAccountant(Accountant):
    """The Gaussian-DP central-limit approximation of the same composition (Dong, Roth and Su).

    ``n = rounds * local_steps`` steps of ``C_q(G_mu0)`` are approximately ``mu_tot``-GDP with

        mu_tot = sqrt(2) q sqrt(n) sqrt(e^{mu0^2} Phi(1.5 mu0) + 3 Phi(-0.5 mu0) - 2)
               = 2 C sqrt(n) / (m sigma) (1 + O(mu0^2)),

    the closed form for sampling without replacement (the one Opacus's GDP accountant uses with
    ``poisson=False``). It is accurate when ``q`` is small and ``n`` large; it is not an upper
    bound, so use it to read budgets, and :class:`ExactAccountant` to calibrate.
    """

    name = "clt"
    upper_bound = False

    @staticmethod
    def mu_total(step: GaussianStep, steps: int) -> float:
        """``mu_tot`` of ``steps`` steps of ``step``.

        The bracket is rewritten with ``g(x) = Phi(x) - 1/2 = erf(x / sqrt 2) / 2`` as
        ``expm1(mu0^2) / 2 + expm1(mu0^2) g(1.5 mu0) + (g(1.5 mu0) - 3 g(0.5 mu0))``, which keeps full
        relative precision for small ``mu0`` (the three terms of the textbook form cancel to
        ``mu0^2 / 2``).
        """
        mu0 = step.mu
        growth = math.expm1(mu0 * mu0)
        g_wide = 0.5 * math.erf(1.5 * mu0 / math.sqrt(2.0))
        g_narrow = 0.5 * math.erf(0.5 * mu0 / math.sqrt(2.0))
        bracket = growth / 2.0 + growth * g_wide + (g_wide - 3.0 * g_narrow)
        return math.sqrt(2.0 * bracket) * step.sampling_rate * math.sqrt(steps)

    def _epsilon(self, step: GaussianStep, rounds: int, local_steps: int, delta: float) -> float:
        return gdp_epsilon(self.mu_total(step, rounds * local_steps), delta)


class PriRFedAccountant(Accountant):
    """PriRFed's round-level accounting: advanced composition of per-round guarantees.

    Each round's ``tau``-step local solver is ``(eps_r, delta_r)``-DP, with ``eps_r`` the exact
    account of the ``tau`` steps (the same step mechanism and sampling; ``ExactAccountant`` at
    discretization 1e-5: one round's losses are small, so a finer grid than a whole transcript's
    is needed, and cheap), and the ``T`` rounds compose by the advanced composition theorem
    (Dwork, Rothblum and Vadhan) with slack ``d_hat = delta / 2``:

        epsilon = sqrt(2 T ln(1 / d_hat)) eps_r + T eps_r (e^{eps_r} - 1),
        delta   = T delta_r + d_hat,   so   delta_r = delta / (2 T).
    """

    name = "prirfed"

    def __init__(self):
        self.round_accountant = ExactAccountant(1e-5)

    @staticmethod
    def compose_rounds(round_epsilon: float, rounds: int, delta: float) -> float:
        """Advanced composition of ``rounds`` rounds of ``round_epsilon`` with slack ``delta / 2``."""
        return (
            math.sqrt(2.0 * rounds * math.log(2.0 / delta)) * round_epsilon
            + rounds * round_epsilon * math.expm1(round_epsilon)
        )

    def _epsilon(self, step: GaussianStep, rounds: int, local_steps: int, delta: float) -> float:
        round_epsilon = self.round_accountant.epsilon(step, rounds=1, local_steps=local_steps,
                                                      delta=delta / (2.0 * rounds))
        return self.compose_rounds(round_epsilon, rounds, delta)

    def config(self) -> dict:
        return {"name": self.name, "round_accountant": self.round_accountant.config()}


ACCOUNTANTS: dict[str, type[Accountant]] = {
    "exact": ExactAccountant,
    "clt": CLTAccountant,
    "prirfed": PriRFedAccountant,
}
"""Accountant classes of the Gaussian step by the name a configuration or the command line uses."""


def calibrate_noise(
    accountant: Accountant,
    step_of: Callable[[float], Step],
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    local_steps: int,
    start: float,
    rtol: float = 1e-7,
) -> float:
    """The smallest noise level ``x`` (to ``rtol``) whose steps ``step_of(x)`` ``accountant``
    certifies ``(epsilon, delta)`` for, after ``rounds`` participations of ``local_steps`` steps.

    The search starts from ``start``, brackets the answer by steps of 25% in ``x``, and solves on
    ``log x`` by Brent's method. The result always satisfies the budget:
    ``accountant.epsilon(step_of(result), ...) <= epsilon``.

    Parameters
    ----------
    accountant : Accountant
    step_of : callable
        The step description at noise level ``x`` (more noise, smaller epsilon).
    epsilon, delta : float
        Target, > 0, and delta in (0, 1); assumed validated.
    rounds, local_steps : int
        >= 1; assumed validated.
    start : float
        A first guess of ``x``, > 0.
    rtol : float
        Relative tolerance on ``x``.
    """
    require_upper_bound(accountant)
    rtol = checks.positive("rtol", rtol)

    @functools.lru_cache(maxsize=None)
    def excess(log_noise: float) -> float:
        return accountant.epsilon(step_of(math.exp(log_noise)), rounds=rounds, local_steps=local_steps,
                                  delta=delta) - epsilon

    step = math.log(1.25)
    low = high = math.log(start)
    if excess(high) > 0:
        while excess(high) > 0:
            low, high = high, high + step
    else:
        while excess(low) <= 0:
            low, high = low - step, low
    from scipy import optimize  # here, not with the module: a client actor imports it, never needs scipy

    log_noise = optimize.brentq(excess, low, high, xtol=rtol / 4, rtol=rtol / 4)
    while excess(log_noise) > 0:
        log_noise = min(log_noise + rtol / 4, high)
    return math.exp(log_noise)

UPPER_BOUNDS = tuple(name for name, cls in ACCOUNTANTS.items() if cls.upper_bound)
"""The accountants whose epsilon is a guarantee: the only ones runs, ledgers and calibration use."""


def require_upper_bound(accountant: Accountant) -> Accountant:
    """``accountant``, checked to bound epsilon from above (what spends or plans budget needs).

    Raises
    ------
    PrivacyParameterError
        Naming ``accountant`` for an approximation such as ``clt``.
    """
    if not accountant.upper_bound:
        raise checks.PrivacyParameterError(
            "accountant", accountant.name,
            f"must be one of {', '.join(UPPER_BOUNDS)}: {accountant.name} is an approximation, not an upper bound on "
            "epsilon, so it cannot calibrate, charge or halt a run (it only reads budgets: rfedray privacy epsilon)",
        )
    return accountant


def calibrate_sigma(
    accountant: Accountant,
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    local_steps: int,
    batch_size: int,
    records: int,
    clip: float,
    rtol: float = 1e-7,
) -> float:
    """The smallest sigma (to ``rtol``) of a clipped mean's Gaussian noise with which ``accountant``
    certifies ``(epsilon, delta)`` (:func:`calibrate_noise` on :meth:`GaussianStep.clipped_mean`).

    Only an accountant that bounds epsilon from above can certify (:func:`require_upper_bound`).

    The search starts from the leading-order GDP value ``sigma_0 = 2 C sqrt(T tau) / (m mu)``,
    ``mu`` the GDP parameter meeting ``(epsilon, delta)``. The result always satisfies the budget.

    Parameters
    ----------
    accountant : Accountant
        Of :class:`GaussianStep`.
    epsilon : float
        Target, > 0.
    delta : float
        In (0, 1).
    rounds, local_steps : int
        Participations ``T`` and local steps ``tau``, both >= 1.
    batch_size, records : int
        ``B`` and ``m`` (use the smallest client), ``1 <= B <= m``.
    clip : float
        > 0.
    rtol : float
        Relative tolerance on sigma.

    Returns
    -------
    float
        sigma, the absolute noise standard deviation.
    """
    require_upper_bound(accountant)
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    rounds = checks.positive_int("rounds", rounds)
    local_steps = checks.positive_int("local_steps", local_steps)
    batch_size, records = checks.batch_within(batch_size, records)
    clip = checks.positive("clip", clip)
    checks.positive("rtol", rtol)
    start = 2.0 * clip * math.sqrt(rounds * local_steps) / (records * gdp_mu(epsilon, delta))
    return calibrate_noise(
        accountant, lambda sigma: GaussianStep.clipped_mean(sigma=sigma, clip=clip, batch_size=batch_size, records=records),
        epsilon=epsilon, delta=delta, rounds=rounds, local_steps=local_steps, start=start, rtol=rtol,
    )

