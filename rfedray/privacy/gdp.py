"""Gaussian differential privacy (Dong, Roth and Su 2022): closed forms and trade-off functions.

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


def gaussian_tradeoff(alpha: np.ndarray, mu: float) -> np.ndarray:
    """``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``, elementwise on ``alpha`` in [0, 1] (any shape)."""
    from scipy import special

    mu = checks.positive("mu", mu)
    alpha = np.asarray(alpha, dtype=np.float64)
    return special.ndtr(special.ndtri(1.0 - alpha) - mu)


def subsampled_tradeoff(alpha: np.ndarray, mu: float, sampling_rate: float) -> np.ndarray:
    """``C_q(G_mu)``: the trade-off of one Gaussian step under sampling without replacement.

    With ``f_q = q G_mu + (1 - q) Id``, ``C_q(G_mu) = min(f_q, f_q^-1)**`` (Dong, Roth and Su,
    Theorem 4.2). Since ``G_mu`` is symmetric, this is ``f_q`` up to ``alpha* = Phi(-mu / 2)``
    (where ``f_q`` has slope -1), then the segment of slope -1 down to ``f_q(alpha*)``, then
    ``f_q^-1``.

    Parameters
    ----------
    alpha : array_like
        Type I errors in [0, 1], any shape.
    mu : float
        > 0.
    sampling_rate : float
        ``q`` in (0, 1].

    Returns
    -------
    numpy.ndarray
        The smallest achievable type II errors, the shape of ``alpha``.
    """
    mu = checks.positive("mu", mu)
    q = checks.sampling_rate("sampling_rate", sampling_rate)
    alpha = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
    shape = alpha.shape
    alpha = alpha.reshape(-1)

    def f_q(a: np.ndarray) -> np.ndarray:
        return q * gaussian_tradeoff(a, mu) + (1.0 - q) * (1.0 - a)

    def f_q_inverse(b: np.ndarray) -> np.ndarray:
        lo, hi = np.zeros_like(b), np.ones_like(b)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            above = f_q(mid) > b
            lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
        return hi

    from scipy import special

    corner = float(special.ndtr(-mu / 2.0))
    corner_value = float(f_q(np.array(corner)))
    result = corner + corner_value - alpha
    steep, flat_end = alpha <= corner, alpha > corner_value
    result[steep] = f_q(alpha[steep])
    result[flat_end] = f_q_inverse(alpha[flat_end])
    return result.reshape(shape)
