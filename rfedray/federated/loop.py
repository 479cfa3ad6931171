"""A DP-RFedProj run, the same for every engine: its task, privacy plan and run directory around
the federation loop (Algorithm 1, :mod:`rfedray.federated.rounds`).

After every round, :meth:`Federation.run` logs a line to ``metrics.jsonl``, notifies observers
(progress, Prometheus) and checkpoints every ``run.checkpoint_every`` rounds (resume:
:mod:`rfedray.federated.resume`). Metrics of an oracle (evaluation data computed
   from the training records, :attr:`rfedray.task.EvalData.oracle`) are named ``oracle_*`` and
   reach the observers only with ``monitoring.export_oracle_metrics``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol

from rfedray.config import Config, to_yaml
from rfedray.federated.evaluation import TEST_SETS
from rfedray.federated.executor import Executor
from rfedray.federated.resume import Checkpoints, RunState, WriteAheadLedger, accounting_fingerprint
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.rounds import DPRFedProj, run_rounds
from rfedray.federated.server import Server
from rfedray.federated.setup import (
    GivenTask, build_dataset, build_model, build_scheme, check_client_sizes, initial_params, local_plan,
    resolve_privacy,
)
from rfedray.geometry import ProductManifold
from rfedray.privacy.plan import PrivacyPlan
from rfedray.task import FederatedDataset, FederatedModel, Params

log = logging.getLogger(__name__)


class RoundObserver(Protocol):
    """Receives one record per completed round and the summary at the end (progress, metrics)."""

    def on_round(self, record: dict) -> None: ...

    def on_finish(self, summary: dict) -> None: ...


@dataclass
class Federation:
    """A whole federation: configuration, task, privacy plan, server and executor.

    Build it with :meth:`prepare`; run it with :meth:`run`.
    """

    cfg: Config
    run_dir: RunDirectory
    model: FederatedModel
    dataset: FederatedDataset
    sizes: list[int]
    privacy: PrivacyPlan
    observers: list[RoundObserver] = field(default_factory=list)
    ledger_factory: Optional[Callable[[], Any]] = None  # the ledger run() charges; default write_ahead_ledger (Ray: the accountant actor)
    given: Optional[GivenTask] = None  # model or dataset objects of the user's (the Ray engine sends them to its actors)

    @classmethod
    def prepare(cls, cfg: Config, run_dir: RunDirectory, observers: Optional[list] = None,
                given: Optional[GivenTask] = None) -> "Federation":
        """Build the task (from the configuration, or the ``given`` objects) and resolve the privacy
        plan; nothing trains yet."""
        dataset = build_dataset(cfg, given)
        sizes = [int(m) for m in dataset.client_sizes()]
        check_client_sizes(cfg, sizes)
        model = build_model(cfg, dataset.info, given)
        privacy = resolve_privacy(cfg, sizes)
        return cls(cfg, run_dir, model, dataset, sizes, privacy, list(observers or []), given=given)

    @property
    def product(self) -> ProductManifold:
        return ProductManifold(self.model.groups)

    def make_ledger(self):
        """A fresh ledger of the run (a NullLedger when it is not private)."""
        return self.privacy.ledger(self.sizes)

    def write_ahead_ledger(self) -> WriteAheadLedger:
        """The ledger the loop charges on the local engine: it writes ``budget.json`` and the charge
        log before each round trains."""
        return WriteAheadLedger(self.make_ledger(), self.checkpoints().fingerprint, self.run_dir)

    def threads(self, cpus: Optional[int] = None) -> int:
        """torch and BLAS threads of a process with ``cpus`` CPUs (default: this process's) that runs
        this federation's kernels (:func:`rfedray.threads.choose_threads`; ``run.threads`` overrides)."""
        from rfedray.threads import available_cpus, choose_threads

        return choose_threads(self.cfg.federation.batch_size, self.dataset.info.get("record_shape", ()),
                              available_cpus() if cpus is None else cpus, self.cfg.run.threads)

    def local_executor(self) -> Executor:
        """The local engine: every client in this process, its records (training and test split) loaded
        and checked now, before anything is charged (:meth:`LocalExecutor.load`), as client actors do
        when they start; a client once sampled stays loaded (``keep``: all)."""
        from rfedray.federated.executor import LocalExecutor

        n = self.cfg.federation.n_clients
        executor = LocalExecutor(self.cfg, self.dataset, self.model, local_plan(self.cfg, self.privacy), keep=n)
        executor.load(range(n))
        return executor

    def _server(self) -> Server:
        weights = self.sizes if self.cfg.aggregation.weighting == "data_size" else None
        return Server(self.product, build_scheme(self.cfg), weights)

    def run(self, executor: Executor, resume: bool = False) -> dict:
        """Run (or resume) the rounds; return the summary that is also written to ``summary.json``."""
        cfg, rd = self.cfg, self.run_dir
        checkpoints = self.checkpoints()
        ledger = self.ledger_factory() if self.ledger_factory is not None else self.write_ahead_ledger()
        seeded = cfg.privacy.noise_seed is not None
        if seeded and self.privacy.private:
            log.warning("privacy.noise_seed is set: reproducible noise, NOT FOR PRODUCTION")
        # Load every piece of data the server holds before the run directory is touched: a bad input fails here.
        evaluation = TEST_SETS[cfg.run.test_set](self, executor)
        state = checkpoints.resume(ledger) if resume else self._start(checkpoints, ledger)
        strategy = DPRFedProj(executor, self._server(), evaluation, cfg, state)

        def finish(record: dict, theta: Params, auth) -> None:
            record["ledger_charges"] = auth.state["charges"] if auth.state is not None else None
            rd.append_metrics(record)
            exported = record if cfg.monitoring.export_oracle_metrics else without_oracle_metrics(record)
            for obs in self.observers:
                obs.on_round(exported)
            done = record["round"] + 1
            if done % cfg.run.checkpoint_every == 0 or done == cfg.run.rounds or rd.out_of_space():
                checkpoints.save(RunState(theta, done, strategy.opt_states, strategy.counters, strategy.last_metrics),
                                 auth.state)

        started = time.perf_counter()
        fed = cfg.federation
        outcome = run_rounds(strategy, ledger, state.theta, first=state.round, last=cfg.run.rounds, seed=cfg.run.seed,
                             n_clients=fed.n_clients, clients_per_round=fed.clients_per_round, on_round=finish)
        private = self.privacy.private
        summary = {
            "run_id": rd.run_id,
            "engine": cfg.run.engine,
            **outcome.summary(self.privacy, ledger, cfg.run.rounds, started),
            "epsilon_target": cfg.privacy.epsilon if private else None,
            "sigma": self.privacy.sigma,
            "clip": cfg.privacy.clip if private else None,
            "private": private,
            "not_for_production": seeded,
            "final_metrics": strategy.last_metrics,
            "oracle_metrics": evaluation.oracle,
            "client_failures": strategy.counters["client_failures"],
            "submissions_rejected": strategy.counters["submissions_rejected"],
        }
        rd.write_model(outcome.theta)
        rd.write_json("summary.json", summary)
        rd.drop_reserve()
        for obs in self.observers:
            obs.on_finish(summary)
        return summary

    def checkpoints(self) -> Checkpoints:
        """The run directory's checkpoint and write-ahead ledger, for this configuration."""
        fingerprint = accounting_fingerprint(self.cfg, self.privacy, self.sizes)
        return Checkpoints(self.run_dir, fingerprint, self.cfg.run.rounds, initial_params(self.cfg, self.model))

    def check_resume(self) -> RunState:
        """Check, writing nothing, that this configuration can resume the run directory (see
        :meth:`Checkpoints.check`); an engine that starts other processes (Ray) calls it first."""
        return self.checkpoints().check(self.make_ledger())

    def _start(self, checkpoints: Checkpoints, ledger) -> RunState:
        """A new run: ``config.yaml``, then the ledger's files and the checkpoint of round 0."""
        # The saved config carries the resolved sigma, so a resume (even one that extends
        # run.rounds) keeps the mechanism the ledger was charged for.
        resolved = replace(self.cfg, privacy=replace(self.cfg.privacy, sigma=self.privacy.sigma))
        self.run_dir.write_bytes("config.yaml", to_yaml(resolved).encode())
        return checkpoints.start(ledger)


def without_oracle_metrics(record: dict) -> dict:
    """A round record without its oracle metrics (``metric_oracle_*``)."""
    return {k: v for k, v in record.items() if not k.startswith("metric_oracle_")}


def run_federation(cfg: Config, run_dir: RunDirectory, observers: Optional[list] = None,
                   executor_factory: Optional[Callable[[Federation], Executor]] = None, resume: bool = False) -> dict:
    """Prepare and run a federation with the local executor (or the one ``executor_factory`` makes)."""
    fed = Federation.prepare(cfg, run_dir, observers)
    executor = executor_factory(fed) if executor_factory is not None else fed.local_executor()
    try:
        return fed.run(executor, resume=resume)
    finally:
        executor.close()


