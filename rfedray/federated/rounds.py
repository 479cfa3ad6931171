"""Algorithm 1: the federation loop, the same for every system and engine, and DP-RFedProj's round.

A strategy says what a round is (the clients' task, what it charges the ledger, how the server
combines).

One round t:

1. draw the cohort S_t: ``k`` of the ``n`` clients, without replacement, a public function of the
   run's seed and ``t`` (:func:`rfedray.federated.server.cohort`);
2. charge the ledger for what the clients of S_t will release (the strategy's participations),
   before they run (a :class:`~rfedray.federated.resume.WriteAheadLedger` persists it first): if a
   client would pass the target epsilon, nothing is charged and the run halts;
3. the strategy's round: the clients' task on S_t from theta_t, and the server's combination of
   their answers into theta_{t+1};
4. the round's record, with the epsilon spent, goes to the caller (metrics, observers,
   checkpoints); a strategy may end the run after it (early stopping).

The strategies: DP-RFedProj (:class:`DPRFedProj`; a run: :class:`rfedray.federated.loop.Federation`,
also the audit's trials),
M-estimation's FedSGD, FedAvg, FedHybrid and FedNewton
(:class:`rfedray.mestimation.runner.MEstimationRound`) and DDP-SA
(:class:`rfedray.ddpsa.runner.DDPSARound`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

from rfedray.config import Config
from rfedray.federated.client import LocalResult
from rfedray.federated.executor import Executor
from rfedray.federated.server import Server, cohort
from rfedray.privacy.ledger import Authorization
from rfedray.privacy.plan import PrivacyPlan
from rfedray.privacy.statement import statement
from rfedray.task import Params

log = logging.getLogger(__name__)


class Strategy(ABC):
    """What a round is."""

    def participations(self, t: int) -> int:
        """Participations (of the plan's local steps) each client of round ``t``'s cohort releases:
        what the ledger is charged before the clients run (one by default)."""
        return 1

    @abstractmethod
    def round(self, chosen: list[int], theta: Params, t: int) -> tuple[Params, dict]:
        """The clients' task on ``chosen`` from ``theta`` (theta_t) and the server's combination:
        theta_{t+1} and what the round reports."""

    def stop(self, record: dict) -> bool:
        """Whether the run ends after the round of ``record`` (early stopping; never by default)."""
        return False


@dataclass(frozen=True)
class Outcome:
    """How the rounds ended.

    Attributes
    ----------
    theta : dict of Tensor
        The last model.
    rounds_completed : int
        The index of the next round (the rounds before it are done).
    records : list of dict
        Every round's record.
    halted : bool
        The ledger refused a round (``halt_reason`` says which client would pass the target).
    stopped_early : bool
        The strategy ended the run.
    """

    theta: Params
    rounds_completed: int
    records: list[dict] = field(default_factory=list)
    halted: bool = False
    halt_reason: str = ""
    stopped_early: bool = False

    def summary(self, plan: PrivacyPlan, ledger, rounds: int, started: float) -> dict:
        """What every run's summary says (each system completes it): its rounds of ``rounds`` and
        its halt, the privacy spent on ``ledger`` under ``plan`` and what it covers
        (:func:`~rfedray.privacy.statement.statement`), the wall time since ``started`` (``time.perf_counter``)."""
        private = plan.private
        return {
            "rounds_completed": self.rounds_completed, "rounds_planned": rounds,
            "halted": self.halted, "halt_reason": self.halt_reason,
            "epsilon_spent": ledger.epsilon_spent(), "delta": plan.delta if private else None,
            "accountant": plan.accountant if private else None, **(statement() if private else {}),
            "wall_seconds": time.perf_counter() - started,
        }


def run_rounds(strategy: Strategy, ledger, theta: Params, *, first: int, last: int, seed: int, n_clients: int,
               clients_per_round: int,
               on_round: Optional[Callable[[dict, Params, Authorization], None]] = None) -> Outcome:
    """Rounds ``first`` to ``last - 1`` of ``strategy``, charged to ``ledger``.

    Parameters
    ----------
    strategy : Strategy
    ledger
        Its ``authorize(cohort, count, round)`` charges a round (a PrivacyLedger, a NullLedger, a
        WriteAheadLedger or the accountant actor's RemoteLedger).
    theta : dict of Tensor
        theta_first.
    first, last : int
        The rounds to run, ``range(first, last)``.
    seed, n_clients, clients_per_round : int
        Draw the cohorts.
    on_round : callable, optional
        ``on_round(record, theta, authorization)`` after every round: the round's record (its
        ``round``, the strategy's report, ``epsilon_spent`` and ``round_seconds``), theta_{t+1}
        and the ledger's answer (its state is what a checkpoint keeps).
    """
    records: list[dict] = []
    for t in range(first, last):
        started = time.perf_counter()
        chosen = cohort(seed, t, n_clients, clients_per_round)
        auth = ledger.authorize(chosen, strategy.participations(t), t)
        if not auth.granted:
            return Outcome(theta, t, records, halted=True, halt_reason=auth.reason)
        theta, report = strategy.round(chosen, theta, t)
        record = {"round": t, **report, "epsilon_spent": auth.epsilon_after,
                  "round_seconds": time.perf_counter() - started}
        records.append(record)
        if on_round is not None:
            on_round(record, theta, auth)
        if strategy.stop(record):
            return Outcome(theta, t + 1, records, stopped_early=True)
    return Outcome(theta, max(first, last), records)


class DPRFedProj(Strategy):
    """Algorithm 1's round: each client of the
    cohort runs ``tau`` private steps from theta_t (the executor: this process, or Ray's client
    actors), and the server checks and combines their submissions into theta_{t+1} (theta_t stays
    if none is usable); every ``run.evaluate_every`` rounds the model is evaluated (on the clients'
    test splits or the server's test set: :mod:`rfedray.federated.evaluation`).

    Parameters
    ----------
    executor : Executor
    server : Server
    evaluation : Evaluation
    cfg : Config
    state : RunState
        Where the run starts (:mod:`rfedray.federated.resume`): the clients' optimiser states, the
        counters and the last metrics, which the rounds update.
    """

    def __init__(self, executor: Executor, server: Server, evaluation, cfg: Config, state):
        self.executor, self.server, self.evaluation, self.cfg = executor, server, evaluation, cfg
        self.opt_states: dict[int, dict] = state.optimizer_states
        self.counters: dict[str, int] = state.counters
        self.last_metrics: dict[str, float] = state.last_metrics

    def round(self, chosen: list[int], theta: Params, t: int) -> tuple[Params, dict]:
        results = self.executor.train(chosen, theta, t, self.opt_states)
        answered = {cid: r for cid, r in results.items() if isinstance(r, LocalResult)}
        failures = [cid for cid in chosen if not isinstance(results.get(cid), LocalResult)]
        agg_start = time.perf_counter()
        theta, rejected = self.server.aggregate(theta, {cid: r.submission for cid, r in answered.items()})
        agg_seconds = time.perf_counter() - agg_start
        rejected_ids = {r.client_id for r in rejected}
        for cid, r in answered.items():
            if cid not in rejected_ids:
                self.opt_states[cid] = r.optimizer_state
        for r in rejected:
            log.warning("round %d: submission rejected: %s", t, r.reason)
        self.counters["client_failures"] += len(failures)
        self.counters["submissions_rejected"] += len(rejected)
        rounds, every = self.cfg.run.rounds, self.cfg.run.evaluate_every
        evaluated = {}
        if (t + 1) % every == 0 or t + 1 == rounds:
            outcome = self.evaluation.evaluate(theta, t)
            self.last_metrics = self.last_metrics if outcome.metrics is None else outcome.metrics
            evaluated = outcome.fields
        return theta, {
            "cohort_size": len(chosen),
            "answered": len(answered) - len(rejected_ids & set(answered)),
            "failed": len(failures),
            "rejected": len(rejected),
            "aggregation_seconds": agg_seconds,
            "local_train_seconds": sorted(r.train_seconds for r in answered.values()),  # no client order
            **evaluated,
            **{f"metric_{k}": v for k, v in self.last_metrics.items()},
        }
