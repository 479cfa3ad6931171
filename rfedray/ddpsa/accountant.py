"""A Laplace accountant beside the project's Gaussian ones: the PLD of subsampled Laplace steps.

One DDP-SA step releases, for every layer ``l``, the mean of per-record gradients clipped to
L1 norm ``C_l`` plus Laplace noise of scale ``b_l`` per coordinate (and, in the private-quantile
variant, per-layer clip counts plus Laplace noise of scale ``b_c``). Replacing one record moves
layer ``l``'s mean by at most ``2 C_l / B`` in L1 and each count by at most 1. Rescaling every
released coordinate by its noise scale (post-processing, invertible) gives unit Laplace noise on a
vector whose shift has L1 norm at most

    r = sum_l 2 C_l / (B b_l) + (number of counts) / b_c,

and a product of unit Laplace laws shifted by a vector of L1 norm ``r`` is dominated by the
one-dimensional pair ``(Lap(r, 1), Lap(0, 1))`` (the per-coordinate losses add up to at most the
shift's L1 norm, and the 1-D pair has the largest hockey-stick divergence among them). With
``b_l = z 2 C_l / B`` each layer contributes ``1 / z``, whatever its clip.

Under sampling without replacement at ``q = B / m`` (replace-one), the step is ``C_q(f_r)``, ``f_r``
the Laplace trade-off function; its PLD is built as :func:`rfedray.privacy.pld.subsampled_gaussian_pld`
builds the Gaussian one: the "remove" pair ``q Lap(r) + (1 - q) Lap(0)`` against ``Lap(0)`` for
losses > 0, mirrored to negative losses (``omega(-l) = e^{-l} omega(l)``), the rest at 0, discretised
pessimistically ("connect the dots"), composed by :class:`rfedray.privacy.pld.DiscretePLD`. The loss
is bounded by ``log(q e^r + 1 - q)`` (reached with positive probability, an atom), so there is no
infinite-loss mass.

:class:`LaplaceAccountant` implements :class:`rfedray.privacy.accountants.Accountant` with
``sigma`` read as the Laplace scale ``b`` of the clipped mean (so ``mu0 = 2 C / (B b) = r``): the
project's :class:`~rfedray.privacy.ledger.PrivacyLedger` and
:func:`~rfedray.privacy.accountants.calibrate_sigma` work with it unchanged.
"""

from __future__ import annotations

import math

import numpy as np

from rfedray.privacy import checks
from rfedray.privacy.accountants import PLDAccountant
from rfedray.privacy.pld import DiscretePLD


def subsampled_laplace_pld(ratio: float, sampling_rate: float, discretization: float = 1e-4) -> DiscretePLD:
    """The symmetric PLD of ``C_q(f_r)``: one Laplace step of sensitivity-to-scale ``ratio`` at rate ``q``.

    Parameters
    ----------
    ratio : float
        ``r = Delta_1 / b`` > 0.
    sampling_rate : float
        ``q = B / m`` in (0, 1].
    discretization : float
        Grid step ``h`` of the losses, > 0.

    Returns
    -------
    DiscretePLD
        On ``[-J h, J h]`` with ``J h >= log(q e^r + 1 - q)``.
    """
    r = checks.positive("ratio", ratio)
    q = checks.sampling_rate("sampling_rate", sampling_rate)
    h = checks.positive("discretization", discretization)
    top_loss = math.log(q * math.exp(r) + 1.0 - q) if r < 700 else math.log(q) + r
    cells = max(1, math.ceil(top_loss / h - 1e-9))
    grid = np.arange(cells + 1) * h
    # x(y): output where log(q e^{s(x)} + 1 - q) = y, s(x) = 2x - r on [0, r]; capped at r (the atom).
    s = np.log1p(np.expm1(np.minimum(grid, top_loss)) / q)
    x = np.minimum((s + r) / 2.0, r)
    survival_q = 0.5 * np.exp(-x)
    survival_p = q * (1.0 - 0.5 * np.exp(x - r)) + (1.0 - q) * survival_q
    survival_q[-1] = 0.0
    survival_p[-1] = 0.0
    mass_p = survival_p[:-1] - survival_p[1:]
    mass_q = survival_q[:-1] - survival_q[1:]
    upper_share = np.clip((mass_p - mass_q * np.exp(grid[:-1])) / -math.expm1(-h), 0.0, mass_p)
    positive = np.zeros(cells + 1)
    positive[:-1] += mass_p - upper_share
    positive[1:] += upper_share
    mirrored = positive * np.exp(-grid)
    p_above_zero = q * (1.0 - 0.5 * math.exp(-r / 2.0)) + (1.0 - q) * 0.5 * math.exp(-r / 2.0)
    q_above_zero = 0.5 * math.exp(-r / 2.0)
    at_zero = positive[0] + mirrored[0] + max(0.0, 1.0 - p_above_zero - q_above_zero)
    probs = np.concatenate([mirrored[:0:-1], [at_zero], positive[1:]])
    return DiscretePLD(h, -cells, probs, 0.0)


class LaplaceAccountant(PLDAccountant):
    """Exact (discretised) composition of subsampled Laplace steps.

    ``sigma`` is the Laplace scale ``b`` of the clipped mean and ``clip`` its L1 clip, so that
    ``StepMechanism.mu = 2 C / (B b)`` is the step's sensitivity-to-scale ratio ``r``.

    Parameters
    ----------
    discretization : float
        Grid step of the losses, > 0 (pessimistic; the error on epsilon is of second order in it).
    """

    name = "laplace"
    build_step_pld = staticmethod(subsampled_laplace_pld)


def ledger_scale(ratio: float, batch_size: int) -> float:
    """The ``sigma`` to give a unit-clip ledger so that its ``mu0 = 2 / (B sigma)`` equals ``ratio``."""
    return 2.0 / (batch_size * ratio)
