"""Per-client privacy budgets, charged before the clients train (write-ahead).

A record of client ``i`` is only exposed in the rounds ``i`` takes part in: the transcript is
``(epsilon_i, delta)``-DP for its records with ``epsilon_i`` the accountant's epsilon after ``p_i``
participations of ``tau`` steps at ``q_i = B / m_i``, and the whole transcript's record-level
epsilon is the largest ``epsilon_i``. Every ``epsilon_i`` is non-increasing in ``m_i`` and
non-decreasing in ``p_i``, so the maximum is reached on the clients that no other client dominates
(smaller or equal ``m`` and at least as many participations); only those are evaluated.

The ledger keeps one cached epsilon per ``(m, p)`` it has met. In a round, the participation
count of each ``m`` grows by at most one, so at most one new evaluation per distinct ``m`` of the
cohort is needed, and the accountant composes it from its cached one-step transform.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from rfedray.privacy import checks

if TYPE_CHECKING:
    from rfedray.privacy.accountants import Accountant

STATE_FORMAT = "rfedray.privacy.ledger/1"


@dataclass(frozen=True)
class Authorization:
    """The answer of :meth:`PrivacyLedger.authorize`.

    Attributes
    ----------
    granted : bool
        Whether the cohort was charged and may train.
    reason : str
        Why not (names the client and the numbers), or what was charged.
    epsilon_after : float or None
        The transcript epsilon after this call (unchanged when refused); None when not private.
    state : dict or None
        The ledger's :meth:`~PrivacyLedger.state_dict` after this call (what a checkpoint keeps), so
        that a remote ledger answers a round in one call; None when not private.
    """

    granted: bool
    reason: str
    epsilon_after: Optional[float]
    state: Optional[dict] = None


def _pareto_front(keys: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ``(m, p)`` pairs no other pair dominates (``m' <= m`` and ``p' >= p``)."""
    front: list[tuple[int, int]] = []
    best_p = -1
    for m, p in sorted(set(keys), key=lambda k: (k[0], -k[1])):
        if p > best_p:
            front.append((m, p))
            best_p = p
    return front


class PrivacyLedger:
    """Per-client participation counts and the record-level epsilon they have spent.

    Parameters
    ----------
    accountant : Accountant
        Of the mechanism's steps, and one that bounds epsilon from above (never the ``clt`` approximation).
    mechanism : GaussianMechanism or LaplaceMechanism
        What every private step does (:mod:`rfedray.privacy.plan`): ``mechanism.step(m)`` describes
        the step of a client of ``m`` records, its batch size ``B`` is at most the smallest client's,
        and its fields are the parameters the ledger's state records.
    local_steps : int
        Steps of one participation (``tau``), >= 1.
    delta : float
        In (0, 1).
    epsilon_target : float or None
        Refuse any round that would take a client above it; ``None`` never refuses.
    client_sizes : sequence of int
        ``m_i`` of every client (public metadata), each >= ``batch_size``.
    """

    def __init__(
        self,
        accountant: "Accountant",
        mechanism,
        *,
        local_steps: int,
        delta: float,
        epsilon_target: Optional[float],
        client_sizes: Sequence[int],
    ):
        from rfedray.privacy.accountants import require_upper_bound

        self.accountant = require_upper_bound(accountant)
        self.mechanism = mechanism
        self.local_steps = checks.positive_int("local_steps", local_steps)
        self.delta = checks.open_unit("delta", delta)
        self.epsilon_target = None if epsilon_target is None else checks.positive("epsilon_target", epsilon_target)
        sizes = list(client_sizes)
        if not sizes:
            raise checks.PrivacyParameterError("client_sizes", sizes, "must list at least one client")
        self.batch_size = checks.positive_int("batch_size", mechanism.batch_size)
        for i, m in enumerate(sizes):
            try:
                checks.batch_within(self.batch_size, m)
            except checks.PrivacyParameterError:
                raise checks.PrivacyParameterError(
                    f"client_sizes[{i}]", m, f"must be an integer >= batch_size={self.batch_size}"
                ) from None
        self.client_sizes = [int(m) for m in sizes]
        self._participations = [0] * len(sizes)
        self._epsilons: dict[tuple[int, int], float] = {}
        self._spent = 0.0
        self._charges = 0

    def _epsilon(self, records: int, participations: int) -> float:
        key = (records, participations)
        if key not in self._epsilons:
            self._epsilons[key] = self.accountant.epsilon(
                self.mechanism.step(records), rounds=participations, local_steps=self.local_steps, delta=self.delta,
            )
        return self._epsilons[key]

    def _check_client(self, client: Any) -> int:
        allowed = f"must be an integer in [0, {len(self.client_sizes) - 1}]"
        try:
            i = operator.index(client)
        except TypeError:
            raise checks.PrivacyParameterError("client", client, allowed) from None
        if isinstance(client, bool) or not 0 <= i < len(self.client_sizes):
            raise checks.PrivacyParameterError("client", client, allowed)
        return i

    def authorize(self, cohort: Sequence[int], count: int = 1, round: Optional[int] = None) -> Authorization:
        """Charge ``count`` participations to every client of ``cohort``, unless one would exceed the target.

        Call it before the cohort trains; persist :meth:`state_dict` before training too, so that
        a crash never loses a charge.

        Parameters
        ----------
        cohort : sequence of int
            Distinct client indices.
        count : int
            Participations (of ``local_steps`` steps) each client releases in the round, >= 1.
        round : int, optional
            The round charged (what a ledger that writes its charges records; unused here).

        Returns
        -------
        Authorization
            ``granted=False`` (and nothing charged) if some client would exceed ``epsilon_target``.
        """
        clients = [self._check_client(c) for c in cohort]
        if len(set(clients)) != len(clients):
            raise checks.PrivacyParameterError("cohort", list(cohort), "must not repeat a client")
        count = checks.positive_int("count", count)
        wanted = {(self.client_sizes[i], self._participations[i] + count): i for i in clients}
        worst = max(
            ((self._epsilon(m, p), wanted[(m, p)], m, p) for m, p in _pareto_front(wanted)),
            default=(0.0, -1, 0, 0),
        )
        epsilon, client, records, participation = worst
        if self.epsilon_target is not None and epsilon > self.epsilon_target:
            return Authorization(
                False,
                f"client {client} (m={records} records) would reach epsilon={epsilon:.6g} > "
                f"epsilon_target={self.epsilon_target:g} (delta={self.delta:g}) at participation {participation}; "
                "nothing was charged",
                self._spent,
            )
        for i in clients:
            self._participations[i] += count
        self._spent = max(self._spent, epsilon)
        self._charges += 1
        charged = "one participation" if count == 1 else f"{count} participations"
        return Authorization(True, f"charged {charged} to {len(clients)} clients", self._spent, self.state_dict())

    def prepare(self) -> None:
        """Evaluate now the epsilon of the smallest client's next participation, so that the next charge
        finds the accountant's libraries loaded and that client's one-step PLD built (on the development
        machine, 0.2-0.8 s the first time: scipy's import and the PLD). Nothing is charged; the epsilons
        are the same as without it."""
        smallest = min(range(len(self.client_sizes)), key=lambda i: (self.client_sizes[i], i))
        self._epsilon(self.client_sizes[smallest], self._participations[smallest] + 1)

    def epsilon_spent(self) -> float:
        """The transcript's record-level epsilon: the largest client epsilon (0 before any round)."""
        return self._spent

    def client_epsilon(self, client: int) -> float:
        """Epsilon spent so far by the records of ``client``."""
        i = self._check_client(client)
        return self._epsilon(self.client_sizes[i], self._participations[i])

    def participations(self, client: int) -> int:
        """Number of rounds ``client`` has been charged for."""
        return self._participations[self._check_client(client)]

    def _mechanism(self) -> dict[str, Any]:
        return {
            "accountant": self.accountant.config(),
            **dataclasses.asdict(self.mechanism),
            "local_steps": self.local_steps,
            "delta": self.delta,
            "client_sizes": list(self.client_sizes),
        }

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot: the mechanism, the target, every participation count, the charges."""
        return {
            "format": STATE_FORMAT,
            **self._mechanism(),
            "epsilon_target": self.epsilon_target,
            "participations": list(self._participations),
            "epsilon_spent": self._spent,
            "charges": self._charges,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the participation counts of a snapshot taken with the same mechanism.

        The transcript epsilon is recomputed from the counts (and never reported below the saved
        one). ``epsilon_target`` is this ledger's own (a resumed run may change its policy).

        Raises
        ------
        ValueError
            If the snapshot's format, any mechanism field (accountant, the mechanism's parameters,
            local_steps, delta, client_sizes) or its participation counts do not fit this ledger.
        """
        if state.get("format") != STATE_FORMAT:
            raise checks.PrivacyParameterError("format", state.get("format"), f"must be {STATE_FORMAT!r}")
        mine = self._mechanism()
        for name in mine:
            if state.get(name) != mine[name]:
                raise checks.PrivacyParameterError(
                    name, state.get(name),
                    f"differs from this ledger's {name}={mine[name]!r}; "
                    "a ledger only resumes the mechanism it was charged for",
                )
        counts = state.get("participations")
        if (
            not isinstance(counts, list)
            or len(counts) != len(self.client_sizes)
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
        ):
            raise checks.PrivacyParameterError(
                "participations", counts, f"must be a list of {len(self.client_sizes)} integers >= 0"
            )
        charges = state.get("charges", 0)
        if isinstance(charges, bool) or not isinstance(charges, int) or charges < 0:
            raise checks.PrivacyParameterError("charges", charges, "must be an integer >= 0")
        self._participations = list(counts)
        self._charges = charges
        keys = [(m, p) for m, p in zip(self.client_sizes, counts) if p > 0]
        recomputed = max((self._epsilon(m, p) for m, p in _pareto_front(keys)), default=0.0)
        saved = state.get("epsilon_spent", 0.0)
        self._spent = max(recomputed, float(saved) if isinstance(saved, (int, float)) and math.isfinite(saved) else 0.0)


class NullLedger:
    """The ledger of a run without privacy: every round is granted, nothing is spent or kept."""

    def authorize(self, cohort: Sequence[int], count: int = 1, round: Optional[int] = None) -> Authorization:
        return Authorization(True, "not private: nothing to charge", None, None)

    def prepare(self) -> None:
        """Nothing to evaluate."""

    def epsilon_spent(self) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Nothing to restore (a non-private checkpoint holds no ledger)."""
