"""Gaussian differential privacy (Dong, Roth and Su 2022): the closed forms between mu, epsilon and delta.

``mu``-GDP is the trade-off ``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` of testing ``N(0, 1)``
against ``N(mu, 1)``. It implies ``(epsilon, delta)``-DP for every epsilon with

    delta(epsilon) = Phi(-epsilon / mu + mu / 2) - exp(epsilon) Phi(-epsilon / mu - mu / 2).

scipy is imported by the functions that use it, not with the module: the client actors import the
privacy plan, hence this module, and never need scipy (about 40 MiB per process).
"""

from __future__ import annotations

import math

import numpy as np

from rfedray.privacy import checks


def gdp_delta(mu: float, epsilon: float) -> float:
    """``delta(epsilon)`` of ``mu``-GDP (computed with log-CDFs, stable for large epsilon).

    Parameters
    ----------
    mu : float
        > 0.
    epsilon : float
        >= 0.
    """
    from scipy import special

    mu = checks.positive("mu", mu)
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    first = float(special.log_ndtr(a))
    second = epsilon + float(special.log_ndtr(b))
    if second >= first:
        return 0.0
    return math.exp(first) * -math.expm1(second - first)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ``epsilon >= 0`` at which ``mu``-GDP gives ``delta``.

    Parameters
    ----------
    mu : float
        > 0.
    delta : float
        In (0, 1).
    """
    from scipy import optimize

    mu = checks.positive("mu", mu)
    delta = checks.open_unit("delta", delta)
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    high = max(1.0, mu * mu)
    while gdp_delta(mu, high) > delta:
        high *= 2.0
    return optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, high, xtol=1e-13, rtol=4 * np.finfo(float).eps)


def gdp_mu(epsilon: float, delta: float) -> float:
    """The largest ``mu`` such that ``mu``-GDP is ``(epsilon, delta)``-DP.

    Parameters
    ----------
    epsilon : float
        > 0.
    delta : float
        In (0, 1).
    """
    from scipy import optimize

    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    high = 1.0
    while gdp_delta(high, epsilon) < delta:
        high *= 2.0
    return optimize.brentq(
        lambda m: gdp_delta(m, epsilon) - delta, 1e-12, high, xtol=1e-14, rtol=4 * np.finfo(float).eps
    )

