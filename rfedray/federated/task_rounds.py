"""The run of a system whose clients run client tasks (M-estimation, DDP-SA: :mod:`rfedray.federated.engine`):
its strategy on the federation loop (:func:`rfedray.federated.rounds.run_rounds`), charged to its privacy plan."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from rfedray.federated.rounds import Outcome, Strategy, run_rounds
from rfedray.privacy.plan import PrivacyPlan
from rfedray.task import Params


def run_task_rounds(strategy: Strategy, plan: PrivacyPlan, theta: Params, sizes: Sequence[int], *, rounds: int,
                    seed: int, clients_per_round: int,
                    on_round: Optional[Callable[[dict], None]] = None) -> tuple[Outcome, dict]:
    """Rounds ``0 .. rounds - 1`` of a client-task ``strategy`` on the federation loop, charged to
    ``plan.ledger(sizes)``; the outcome and its :meth:`Outcome.summary` with the target and whether
    the noise was seeded, which the system completes.

    ``on_round`` receives every round's record.
    """
    ledger = plan.ledger(sizes)
    started = time.perf_counter()
    outcome = run_rounds(strategy, ledger, theta, first=0, last=rounds, seed=seed, n_clients=len(sizes),
                         clients_per_round=clients_per_round,
                         on_round=None if on_round is None else lambda record, theta, auth: on_round(record))
    return outcome, {**outcome.summary(plan, ledger, rounds, started), "epsilon_target": plan.epsilon_target,
                     "not_for_production": plan.private and plan.noise_seed is not None}
