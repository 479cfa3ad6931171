"""The privacy plan of a run: the one object the clients' mechanism and the ledger are both built from.

A run's private steps are all the same public mechanism (:class:`GaussianMechanism` for DP-RFedProj
and private M-estimation, :class:`LaplaceMechanism` for DDP-SA). The :class:`PrivacyPlan` holds it
with how it is accounted (accountant, delta), how many steps a participation releases and when the
run must stop (the target epsilon); the clients read their noise and clip from ``plan.mechanism``
and the ledger is ``plan.ledger(client_sizes)``, so the two cannot disagree. A run without privacy
has no mechanism and a :class:`~rfedray.privacy.ledger.NullLedger`.

The plan takes numbers, never a configuration: each system resolves its configuration (and
calibrates the noise) into a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from rfedray.privacy import checks
from rfedray.privacy.accountants import ACCOUNTANTS, Accountant, GaussianStep, LaplaceAccountant, LaplaceStep
from rfedray.privacy.ledger import NullLedger, PrivacyLedger


@dataclass(frozen=True)
class GaussianMechanism:
    """Every private step: the mean of ``B`` records' values clipped to norm ``C``, plus ``N(0, sigma^2 I)``.

    Parameters
    ----------
    sigma : float
        Absolute standard deviation of the noise, > 0.
    clip : float
        ``C`` > 0.
    batch_size : int
        ``B`` >= 1, drawn without replacement.
    """

    sigma: float
    clip: float
    batch_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", checks.positive("sigma", self.sigma))
        object.__setattr__(self, "clip", checks.positive("clip", self.clip))
        object.__setattr__(self, "batch_size", checks.positive_int("batch_size", self.batch_size))

    def step(self, records: int) -> GaussianStep:
        """The step of a client holding ``records`` records (``mu = 2C / (B sigma)``, ``q = B / m``)."""
        return GaussianStep.clipped_mean(sigma=self.sigma, clip=self.clip, batch_size=self.batch_size, records=records)


@dataclass(frozen=True)
class LaplaceMechanism:
    """Every private step: releases of ``B`` records with Laplace noise whose L1 sensitivity over
    scale totals ``ratio`` (see :func:`rfedray.privacy.pld.subsampled_laplace_pld`).

    Parameters
    ----------
    ratio : float
        ``r`` > 0.
    batch_size : int
        ``B`` >= 1, drawn without replacement.
    """

    ratio: float
    batch_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", checks.positive("ratio", self.ratio))
        object.__setattr__(self, "batch_size", checks.positive_int("batch_size", self.batch_size))

    def step(self, records: int) -> LaplaceStep:
        batch, records = checks.batch_within(self.batch_size, records)
        return LaplaceStep(self.ratio, batch / records)


STEP_ACCOUNTANTS: dict[str, type[Accountant]] = {**ACCOUNTANTS, "laplace": LaplaceAccountant}
"""Every accountant by name (the Gaussian ones and DDP-SA's Laplace accountant)."""


@dataclass(frozen=True)
class PrivacyPlan:
    """How a run is private: its mechanism, how it is accounted and when it stops.

    Parameters
    ----------
    mechanism : GaussianMechanism, LaplaceMechanism or None
        Every private step of every client; None for a run without privacy.
    accountant : str
        A key of :data:`STEP_ACCOUNTANTS` accounting the mechanism's steps.
    delta : float
        In (0, 1).
    epsilon_target : float or None
        The ledger refuses a round that would take a client above it (the run halts); None never
        refuses.
    local_steps : int
        Steps one participation releases (``tau``), the ledger's unit of charge.
    noise_seed : int or None
        ``None``: noise from OS entropy. An integer makes the run reproducible, not for production.
    """

    mechanism: Optional[Union[GaussianMechanism, LaplaceMechanism]]
    accountant: str = "exact"
    delta: float = 1e-5
    epsilon_target: Optional[float] = None
    local_steps: int = 1
    noise_seed: Optional[int] = None

    @property
    def private(self) -> bool:
        return self.mechanism is not None

    @property
    def sigma(self) -> Optional[float]:
        """The Gaussian noise's standard deviation (None without privacy or for a Laplace mechanism)."""
        return getattr(self.mechanism, "sigma", None)

    @property
    def clip(self) -> Optional[float]:
        """The Gaussian mechanism's clip ``C`` (None without privacy or for a Laplace mechanism)."""
        return getattr(self.mechanism, "clip", None)

    def ledger(self, client_sizes: Sequence[int]) -> Union[PrivacyLedger, NullLedger]:
        """The ledger of the run: every client's budget, charged with this plan's mechanism."""
        if self.mechanism is None:
            return NullLedger()
        return PrivacyLedger(
            STEP_ACCOUNTANTS[self.accountant](), self.mechanism, local_steps=self.local_steps, delta=self.delta,
            epsilon_target=self.epsilon_target, client_sizes=client_sizes,
        )
