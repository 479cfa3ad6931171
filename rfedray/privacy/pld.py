"""Discrete privacy-loss distributions (PLDs) and their composition by FFT.

A PLD is the law of the privacy loss ``L = log(dP/dQ)(X)``, ``X ~ P``, of a pair of output
distributions ``(P, Q)`` of a mechanism on adjacent datasets. ``(epsilon, delta)``-DP is read from
it through the hockey-stick divergence

    delta(epsilon) = P(L = inf) + E[(1 - exp(epsilon - L))_+],

and composing mechanisms adds independent losses, so the PLD of ``n`` steps is the ``n``-fold
convolution of one step's PLD.

:func:`subsampled_laplace_pld` builds the PLD of one DDP-SA step (the subsampled Laplace mechanism)
the same way. :func:`subsampled_gaussian_pld` builds the PLD of one private step of DP-RFedProj: the trade-off
function ``C_q(G_mu)`` of Dong, Roth and Su (the Gaussian mechanism ``G_mu`` under sampling
without replacement at rate ``q``, replace-one adjacency). It is the symmetric PLD whose positive
part is that of the "remove" pair ``q N(mu, 1) + (1 - q) N(0, 1)`` against ``N(0, 1)``, mirrored
to negative losses with ``omega(-l) = exp(-l) omega(l)``, the remaining mass at 0 (the flat,
slope -1 piece of ``C_q``). Composing one direction only (a Poisson "remove" PLD) would
under-estimate epsilon.

Discretisation is pessimistic and second-order accurate ("connect the dots", Doroshenko et al.
2022): the mass of each grid cell ``(j h, (j + 1) h]`` is split between its two end points so that
both its ``P`` mass and its ``Q`` mass are kept. The discrete pair then dominates the continuous one
(every delta(epsilon) is an upper bound), and its error is ``O(h^2)`` per step instead of the
``O(h)`` bias of rounding every loss up. Self-composition raises the discrete Fourier transform to
the ``n``-th power on a window ``[L, U]`` given by Chernoff bounds; the mass that may lie above the
window is counted as infinite loss.
"""

from __future__ import annotations

import math

import numpy as np

from rfedray.privacy import checks

TAIL_MASS = 1e-15
"""Probability mass a composition may truncate above its window (added to the infinite loss)."""

STEP_TAIL_MASS = 1e-18
"""Probability of ``P`` beyond the largest loss kept in one step's grid (added to the infinite loss)."""

MAX_GRID = 1 << 26
"""The largest grid (number of loss values) a PLD may use before the computation is refused."""


_SPECTRUM_FLOOR = -700.0
"""Frequencies whose composed magnitude is below ``exp(_SPECTRUM_FLOOR)`` are set to 0."""

_CHERNOFF_GRID = np.geomspace(0.25, 4.0, 10)
"""Multiples of the Gaussian-optimal Chernoff parameter tried by :meth:`DiscretePLD._window`."""

_FFT_LADDER = (8, 9, 10, 12, 14, 15, 16)


def _fft_size(needed: int) -> int:
    """The smallest ``2^k * r / 8`` >= ``needed`` (``r`` in a short ladder of 7-smooth numbers).

    A coarse ladder (at most 12.5% above ``needed``), so that one cached spectrum serves many
    composition counts.
    """
    needed = max(int(needed), 16)
    power = 1 << ((needed - 1).bit_length() - 4)
    return min(power * r for r in _FFT_LADDER if power * r >= needed)


def _check_grid(size: int, discretization: float) -> None:
    if size > MAX_GRID:
        raise checks.PrivacyParameterError(
            "discretization", discretization,
            f"would need a grid of {size} loss values (more than {MAX_GRID}); the privacy loss is far "
            "too large for an exact account (raise sigma or the discretization)",
        )


class DiscretePLD:
    """A privacy-loss distribution on the grid ``h Z`` with an atom at ``+inf``.

    Parameters
    ----------
    discretization : float
        Grid step ``h`` > 0.
    offset : int
        Grid index of ``probs[0]``: the loss of ``probs[i]`` is ``(offset + i) h``.
    probs : numpy.ndarray
        Probability masses, shape ``(K,)``, non-negative.
    infinity_mass : float
        Probability of an infinite loss (added to every delta).

    Notes
    -----
    The forward transform of ``probs`` is cached per transform size, so that composing the same
    PLD for several counts (a ledger charging one round after another) costs one inverse transform
    per count.
    """

    def __init__(self, discretization: float, offset: int, probs: np.ndarray, infinity_mass: float):
        self.discretization = checks.positive("discretization", discretization)
        self.offset = int(offset)
        self.probs = np.asarray(probs, dtype=np.float64)
        if self.probs.ndim != 1 or self.probs.size == 0:
            raise ValueError(f"probs has shape {self.probs.shape}: must be a non-empty 1-D array")
        self.infinity_mass = float(min(max(infinity_mass, 0.0), 1.0))
        self._spectra: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._blocks: tuple | None = None

    @classmethod
    def identity(cls, discretization: float) -> "DiscretePLD":
        """The PLD of a mechanism that reveals nothing: all mass at loss 0."""
        return cls(discretization, 0, np.ones(1), 0.0)

    @property
    def losses(self) -> np.ndarray:
        """Loss value of every entry of :attr:`probs`, shape ``(K,)``."""
        return (self.offset + np.arange(self.probs.size)) * self.discretization

    def _window(self, count: int, tail_mass: float) -> tuple[int, int]:
        """Grid indices ``[lower, upper]`` outside which the ``count``-fold sum has < ``tail_mass`` per side.

        Chernoff: ``P(S > u) <= exp(count * log E[e^{tX}] - t u)`` for every ``t > 0``, minimised over a
        geometric grid of ``t`` around the Gaussian optimum. The moment generating function is taken
        over at most 1024 blocks of the grid, each block's mass put at its top (upper bound) or its
        bottom (lower bound): a dominating variable, so the bounds stay valid.
        """
        if self._blocks is None:
            p = self.probs
            block = -(-p.size // 1024)
            blocks = -(-p.size // block)
            padded = np.zeros(blocks * block)
            padded[: p.size] = p
            mass = padded.reshape(blocks, block).sum(axis=1)
            bottom = self.offset + block * np.arange(blocks, dtype=np.float64)
            total = float(mass.sum())
            mean = float(p @ np.arange(p.size, dtype=np.float64)) / total + self.offset
            spread = math.sqrt(max(float(mass @ (bottom + 0.5 * (block - 1) - mean) ** 2) / total, 1.0))
            self._blocks = (block, mass, bottom, mean, spread)
        block, mass, bottom, mean, spread = self._blocks
        ts = math.sqrt(2.0 * math.log(1.0 / tail_mass) / count) / spread * _CHERNOFF_GRID
        bounds = []
        for sign, position in ((1.0, bottom + (block - 1)), (-1.0, bottom)):
            exponent = sign * ts[:, None] * (position[None, :] - mean)
            top = exponent.max(axis=1)
            log_mgf = np.log(np.exp(exponent - top[:, None]) @ mass) + top
            bounds.append(float(np.min((count * log_mgf - math.log(tail_mass)) / ts)))
        upper = math.ceil(count * mean + bounds[0])
        lower = math.floor(count * mean - bounds[1])
        return max(lower, count * self.offset), min(upper, count * (self.offset + self.probs.size - 1))

    def _spectrum(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Real FFT of :attr:`probs` zero-padded to ``size``, and the log of its modulus.

        Cached for the last two sizes.
        """
        if size not in self._spectra:
            from scipy import fft  # here, not with the module: a client actor imports it, never needs scipy

            if len(self._spectra) >= 2:
                self._spectra.pop(next(iter(self._spectra)))
            spectrum = fft.rfft(self.probs, size)
            with np.errstate(divide="ignore"):
                self._spectra[size] = (spectrum, np.log(np.abs(spectrum)))
        return self._spectra[size]

    def self_compose(self, count: int) -> "DiscretePLD":
        """The PLD of ``count`` independent runs of this mechanism.

        Parameters
        ----------
        count : int
            Number of compositions, >= 0 (0 gives :meth:`identity`).

        Returns
        -------
        DiscretePLD
            On the same grid, with ``infinity_mass = 1 - (1 - inf)^count + TAIL_MASS``: the result
            drops :data:`TAIL_MASS` above its window (counted as infinite loss) and below it.

        Notes
        -----
        The spectrum is raised to the power ``count`` as ``exp(count * log z)``, only where
        ``|z|^count > e^-700`` (elsewhere it is 0 to double precision): after many compositions
        almost every frequency is negligible, so this costs little beyond one inverse FFT.
        """
        count = checks.nonnegative_int("count", count)
        if count == 0:
            return DiscretePLD.identity(self.discretization)
        if count == 1:
            return self
        lower, upper = self._window(count, TAIL_MASS)
        width = upper - lower + 1
        _check_grid(width, self.discretization)
        size = _fft_size(max(width, self.probs.size))
        base, log_modulus = self._spectrum(size)
        kept = np.flatnonzero(log_modulus * count > _SPECTRUM_FLOOR)
        # Shift theorem: multiplying bin k by exp(-2 pi i k s / size) rolls the output by s, so that
        # entry 0 of the inverse transform is the loss index `lower`.
        shift = (count * self.offset - lower) % size
        spectrum = np.zeros(base.size, dtype=np.complex128)
        spectrum[kept] = np.exp(count * np.log(base[kept]) - 2j * np.pi * ((kept * shift) % size) / size)
        from scipy import fft

        composed = fft.irfft(spectrum, size)[:width]
        infinity = -math.expm1(count * math.log1p(-self.infinity_mass)) + TAIL_MASS
        return DiscretePLD(self.discretization, lower, np.clip(composed, 0.0, None), infinity)

    def delta(self, epsilon: float) -> float:
        """Hockey-stick divergence ``inf_mass + sum_{l > epsilon} p_l (1 - exp(epsilon - l))``."""
        epsilon = checks.real_number("epsilon", epsilon)
        losses = self.losses
        above = losses > epsilon
        return float(self.infinity_mass + self.probs[above] @ -np.expm1(epsilon - losses[above]))

    def epsilon(self, delta: float) -> float:
        """The smallest ``epsilon >= 0`` with ``delta(epsilon) <= delta``; ``inf`` if none is finite.

        Between two grid points the set ``{l > epsilon}`` is fixed, so
        ``delta(epsilon) = S1 - exp(epsilon) S2`` with ``S1 = inf + sum p_l`` and
        ``S2 = sum p_l exp(-l)`` over that set, and the answer is ``log((S1 - delta) / S2)``. The
        grid cell is found by bisection on the (non-increasing) delta at the grid points.
        """
        delta = checks.open_unit("delta", delta)
        inf = self.infinity_mass
        if inf > delta:
            return math.inf
        first = max(0, 1 - self.offset)
        probs = self.probs[first:]
        if probs.size == 0:
            return 0.0
        losses = (self.offset + first + np.arange(probs.size)) * self.discretization
        s1 = np.cumsum(probs[::-1])[::-1] + inf
        s2 = np.cumsum((probs * np.exp(-losses))[::-1])[::-1]

        def delta_at(j: int) -> float:
            """delta(epsilon = losses[j]); the set {l > epsilon} is {j + 1, ...}."""
            if j + 1 >= probs.size:
                return inf
            tail = float(s2[j + 1])
            return float(s1[j + 1]) - (math.exp(float(losses[j]) + math.log(tail)) if tail > 0 else 0.0)

        lo, hi = -1, probs.size - 1
        if delta_at(hi) > delta:
            return math.inf
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if delta_at(mid) <= delta:
                hi = mid
            else:
                lo = mid
        floor = float(losses[lo]) if lo >= 0 else 0.0
        if s1[hi] - delta <= 0 or s2[hi] <= 0:
            return floor
        return min(max(math.log((float(s1[hi]) - delta) / float(s2[hi])), floor), float(losses[hi]))


def _mirrored_remove_pair(grid: np.ndarray, h: float, survival_p: np.ndarray, survival_q: np.ndarray,
                          p_above_zero: float, q_above_zero: float) -> np.ndarray:
    """The probabilities of a symmetric PLD on ``[-J h, J h]`` from its "remove" pair's losses >= 0.

    Parameters
    ----------
    grid : ndarray, shape (J + 1,)
        Losses ``y_j = j h``.
    h : float
        Grid step.
    survival_p, survival_q : ndarray, shape (J + 1,)
        ``P(loss > y_j)`` under the pair's two distributions (``P`` the one with the record).
    p_above_zero, q_above_zero : float
        ``P(loss > 0)`` under each; what neither puts above zero (nor, mirrored, below) is at 0.

    Returns
    -------
    ndarray, shape (2 J + 1,)
        Pessimistic ("connect the dots": a at ``y_j``, b at ``y_{j+1}``, with a + b the P-mass
        of the cell and ``a e^{-y_j} + b e^{-y_{j+1}}`` its Q-mass), losses < 0 mirrored
        (``omega(-l) = e^{-l} omega(l)``).
    """
    mass_p = survival_p[:-1] - survival_p[1:]
    mass_q = survival_q[:-1] - survival_q[1:]
    upper_share = np.clip((mass_p - mass_q * np.exp(grid[:-1])) / -math.expm1(-h), 0.0, mass_p)
    positive = np.zeros(len(grid))
    positive[:-1] += mass_p - upper_share
    positive[1:] += upper_share
    mirrored = positive * np.exp(-grid)
    at_zero = positive[0] + mirrored[0] + max(0.0, 1.0 - p_above_zero - q_above_zero)
    return np.concatenate([mirrored[:0:-1], [at_zero], positive[1:]])


def subsampled_gaussian_pld(
    mu: float, sampling_rate: float, discretization: float = 1e-4
) -> DiscretePLD:
    """The symmetric PLD of ``C_q(G_mu)``: one Gaussian step under sampling without replacement.

    Parameters
    ----------
    mu : float
        ``mu0 = sensitivity / sigma``, > 0 (``2 C / (B sigma)`` for the clipped average).
    sampling_rate : float
        ``q = B / m`` in (0, 1]; ``q = 1`` is the plain Gaussian mechanism ``G_mu``.
    discretization : float
        Grid step ``h`` of the losses; ``P`` keeps :data:`STEP_TAIL_MASS` beyond the largest loss of
        the grid, counted as infinite loss.

    Returns
    -------
    DiscretePLD
        On ``[-J h, J h]``, shape ``(2 J + 1,)``, with ``J h`` the largest kept loss.
    """
    mu = checks.positive("mu", mu)
    q = checks.sampling_rate("sampling_rate", sampling_rate)
    h = checks.positive("discretization", discretization)
    from scipy import special

    x_max = mu - float(special.ndtri(STEP_TAIL_MASS))
    top_loss = math.log(q) + mu * x_max - mu * mu / 2.0
    top_loss = top_loss + math.log1p((1.0 - q) * math.exp(-top_loss)) if q < 1.0 else top_loss
    cells = max(1, math.ceil(top_loss / h))
    _check_grid(2 * cells + 1, h)
    grid = np.arange(cells + 1) * h
    # x(y): the output where the remove pair's loss log(q e^{mu x - mu^2/2} + 1 - q) equals y >= 0.
    x = (np.log1p(np.expm1(grid) / q) + mu * mu / 2.0) / mu
    survival_q = special.ndtr(-x)
    survival_p = q * special.ndtr(mu - x) + (1.0 - q) * survival_q
    probs = _mirrored_remove_pair(grid, h, survival_p, survival_q, survival_p[0], survival_q[0])
    return DiscretePLD(h, -cells, probs, float(survival_p[-1]))


def subsampled_laplace_pld(ratio: float, sampling_rate: float, discretization: float = 1e-4) -> DiscretePLD:
    """The symmetric PLD of ``C_q(f_r)``: one Laplace step of sensitivity-to-scale ``ratio`` at rate ``q``.

    A release with Laplace noise whose shift, after rescaling every coordinate by its noise scale,
    has L1 norm at most ``r`` is dominated by the one-dimensional pair ``(Lap(r, 1), Lap(0, 1))``.
    Under sampling without replacement at ``q = B / m`` (replace-one) the step is ``C_q(f_r)``,
    ``f_r`` the Laplace trade-off function; its PLD is built as :func:`subsampled_gaussian_pld` builds
    the Gaussian one: the "remove" pair ``q Lap(r) + (1 - q) Lap(0)`` against ``Lap(0)`` for losses
    > 0, mirrored to negative losses (``omega(-l) = e^{-l} omega(l)``), the rest at 0, discretised
    pessimistically ("connect the dots"). The loss is bounded by ``log(q e^r + 1 - q)`` (reached with
    positive probability, an atom), so there is no infinite-loss mass.

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
    p_above_zero = q * (1.0 - 0.5 * math.exp(-r / 2.0)) + (1.0 - q) * 0.5 * math.exp(-r / 2.0)
    q_above_zero = 0.5 * math.exp(-r / 2.0)
    probs = _mirrored_remove_pair(grid, h, survival_p, survival_q, p_above_zero, q_above_zero)
    return DiscretePLD(h, -cells, probs, 0.0)
