"""The trade-off function of one subsampled Gaussian step, ``C_q(G_mu)`` (Dong, Roth and Su 2022):
the reference the tests hold the accountants' PLD and the privacy audit's bounds against.

``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` is the trade-off of testing ``N(0, 1)`` against
``N(mu, 1)``; the library accounts through privacy-loss distributions (:mod:`rfedray.privacy.pld`)
and never needs the trade-off curve itself.
"""

from __future__ import annotations

import numpy as np
from scipy import special

from rfedray.privacy import checks


def gaussian_tradeoff(alpha: np.ndarray, mu: float) -> np.ndarray:
    """``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``, elementwise on ``alpha`` in [0, 1] (any shape)."""
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

    corner = float(special.ndtr(-mu / 2.0))
    corner_value = float(f_q(np.array(corner)))
    result = corner + corner_value - alpha
    steep, flat_end = alpha <= corner, alpha > corner_value
    result[steep] = f_q(alpha[steep])
    result[flat_end] = f_q_inverse(alpha[flat_end])
    return result.reshape(shape)
