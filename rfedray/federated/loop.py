"""The federation loop of DP-RFedProj, the same for every engine.

One round t:

1. draw the cohort S_t (k of n, without replacement);
2. charge the privacy ledger for every client of S_t and persist it (write-ahead): if a client would
   pass the target epsilon, nothing is charged and the run halts;
3. the executor runs the cohort's local training from theta_t;
4. the server checks and combines the submissions into theta_{t+1} (theta_t stays if none is
   usable);
5. evaluate, log a line to ``metrics.jsonl``, notify observers (progress, Prometheus), and
   checkpoint every ``run.checkpoint_every`` rounds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol

import torch

from rfedray.config import Config, ConfigError, to_yaml
from rfedray.errors import RfedrayError
from rfedray.federated.client import ClientFailure, LocalResult
from rfedray.federated.executor import Executor
from rfedray.federated.rundir import RunDirectory, atomic_write_json
from rfedray.federated.server import Server, cohort
from rfedray.federated.setup import (
    PrivacyPlan, build_dataset, build_model, build_scheme, check_client_sizes, initial_params,
    local_plan, resolve_privacy,
)
from rfedray.geometry import ProductManifold
from rfedray.task import FederatedDataset, FederatedModel, Params

log = logging.getLogger(__name__)


FINGERPRINT_NOTES = {"data.client_sizes": "the clients' record counts differ"}
"""How a changed accounting setting is described when its value is not readable (a hash)."""


def _flatten(fingerprint: dict) -> dict:
    """``{"privacy": {"clip": c}, ...}`` as ``{"privacy.clip": c, ...}``."""
    flat = {}
    for key, value in fingerprint.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


class RoundObserver(Protocol):
    """Receives one record per completed round and the summary at the end (progress, metrics)."""

    def on_round(self, record: dict) -> None: ...

    def on_finish(self, summary: dict) -> None: ...


def accounting_fingerprint(cfg: Config, privacy: PrivacyPlan, sizes: list[int]) -> dict:
    """Everything the ledger's numbers depend on; a resume must not change any of it."""
    return {
        "privacy": privacy.fingerprint(),
        "federation.local_steps": cfg.federation.local_steps,
        "federation.batch_size": cfg.federation.batch_size,
        "federation.n_clients": cfg.federation.n_clients,
        "data.client_sizes": hashlib.sha256(json.dumps(sizes).encode()).hexdigest(),
    }


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
    ledger_factory: Optional[Callable[[], Any]] = None  # the ledger run() charges; default make_ledger (Ray: the accountant actor)

    @classmethod
    def prepare(cls, cfg: Config, run_dir: RunDirectory, observers: Optional[list] = None) -> "Federation":
        """Build the task and resolve the privacy plan; nothing trains yet."""
        dataset = build_dataset(cfg)
        sizes = dataset.client_sizes()
        check_client_sizes(cfg, sizes)
        model = build_model(cfg, dataset.info)
        privacy = resolve_privacy(cfg, sizes)
        return cls(cfg, run_dir, model, dataset, sizes, privacy, list(observers or []))

    @property
    def product(self) -> ProductManifold:
        return ProductManifold(self.model.groups)

    def make_ledger(self):
        from rfedray.privacy.accountants import ACCOUNTANTS, PrivacyLedger

        if not self.privacy.enabled:
            return None
        fed = self.cfg.federation
        return PrivacyLedger(
            ACCOUNTANTS[self.privacy.accountant](), sigma=self.privacy.sigma, clip=self.privacy.clip,
            batch_size=fed.batch_size, local_steps=fed.local_steps, delta=self.privacy.delta,
            epsilon_target=self.privacy.epsilon_target, client_sizes=self.sizes,
        )

    def local_executor(self) -> Executor:
        from rfedray.federated.executor import LocalExecutor

        return LocalExecutor(self.cfg, self.dataset, self.model, local_plan(self.cfg, self.privacy))

    def _server(self) -> Server:
        weights = self.sizes if self.cfg.aggregation.weighting == "data_size" else None
        return Server(self.product, build_scheme(self.cfg), weights)

    def run(self, executor: Executor, resume: bool = False) -> dict:
        """Run (or resume) the rounds; return the summary that is also written to ``summary.json``."""
        cfg, rd = self.cfg, self.run_dir
        ledger = self.ledger_factory() if self.ledger_factory is not None else self.make_ledger()
        server = self._server()
        fingerprint = accounting_fingerprint(cfg, self.privacy, self.sizes)
        seeded = cfg.privacy.noise_seed is not None
        if seeded and self.privacy.enabled:
            log.warning("privacy.noise_seed is set: reproducible noise, NOT FOR PRODUCTION")
        # Load every piece of data before the run directory is touched: a bad input fails here.
        eval_data = self.dataset.eval_data()
        state = self._start_state(ledger, fingerprint, resume)
        theta: Params = state["theta"]
        start_round: int = state["round"]
        opt_states: dict[int, dict] = state["optimizer_states"]
        counters = state["counters"]
        halted, halt_reason = False, ""
        last_metrics: dict[str, float] = state.get("last_metrics", {})
        started = time.perf_counter()
        t = start_round
        for t in range(start_round, cfg.run.rounds):
            round_start = time.perf_counter()
            chosen = cohort(cfg.run.seed, t, cfg.federation.n_clients, cfg.federation.clients_per_round)
            if ledger is not None:
                auth = ledger.authorize(chosen)
                if not auth.granted:
                    halted, halt_reason = True, auth.reason
                    break
                atomic_write_json(rd.budget, {"fingerprint": fingerprint, "ledger": ledger.state_dict(), "round": t})
            results = executor.train(chosen, theta, t, opt_states)
            answered = {cid: r for cid, r in results.items() if isinstance(r, LocalResult)}
            failures = [cid for cid in chosen if not isinstance(results.get(cid), LocalResult)]
            agg_start = time.perf_counter()
            theta, rejected = server.aggregate(theta, {cid: r.submission for cid, r in answered.items()})
            agg_seconds = time.perf_counter() - agg_start
            rejected_ids = {r.client_id for r in rejected}
            for cid, r in answered.items():
                if cid not in rejected_ids:
                    opt_states[cid] = r.optimizer_state
            for r in rejected:
                log.warning("round %d: submission rejected: %s", t, r.reason)
            counters["client_failures"] += len(failures)
            counters["submissions_rejected"] += len(rejected)
            if (t + 1) % cfg.run.evaluate_every == 0 or t + 1 == cfg.run.rounds:
                last_metrics = self.model.evaluate(theta, eval_data)
            record = {
                "round": t,
                "cohort_size": len(chosen),
                "answered": len(answered) - len(rejected_ids & set(answered)),
                "failed": len(failures),
                "rejected": len(rejected),
                "epsilon_spent": ledger.epsilon_spent() if ledger is not None else None,
                "round_seconds": time.perf_counter() - round_start,
                "aggregation_seconds": agg_seconds,
                "local_train_seconds": sorted(r.train_seconds for r in answered.values()),  # no client order
                **{f"metric_{k}": v for k, v in last_metrics.items()},
            }
            rd.append_metrics(record)
            for obs in self.observers:
                obs.on_round(record)
            if (t + 1) % cfg.run.checkpoint_every == 0 or t + 1 == cfg.run.rounds:
                self._checkpoint(theta, t + 1, opt_states, counters, fingerprint, ledger, last_metrics)
        else:
            t = cfg.run.rounds
        rounds_completed = t
        summary = {
            "run_id": rd.run_id,
            "engine": cfg.run.engine,
            "rounds_completed": rounds_completed,
            "rounds_planned": cfg.run.rounds,
            "epsilon_spent": ledger.epsilon_spent() if ledger is not None else None,
            "epsilon_target": cfg.privacy.epsilon if self.privacy.enabled else None,
            "delta": self.privacy.delta if self.privacy.enabled else None,
            "sigma": self.privacy.sigma,
            "clip": self.privacy.clip if self.privacy.enabled else None,
            "accountant": self.privacy.accountant if self.privacy.enabled else None,
            "private": self.privacy.enabled,
            "not_for_production": seeded,
            "halted": halted,
            "halt_reason": halt_reason,
            "final_metrics": last_metrics,
            "client_failures": counters["client_failures"],
            "submissions_rejected": counters["submissions_rejected"],
            "wall_seconds": time.perf_counter() - started,
        }
        torch.save({k: v.detach().cpu() for k, v in theta.items()}, rd.final_model)
        atomic_write_json(rd.summary, summary)
        for obs in self.observers:
            obs.on_finish(summary)
        return summary

    def _checkpoint(self, theta, next_round, opt_states, counters, fingerprint, ledger, last_metrics) -> None:
        self.run_dir.write_checkpoint({
            "round": next_round,
            "theta": {k: v.detach().cpu() for k, v in theta.items()},
            "optimizer_states": opt_states,
            "counters": dict(counters),
            "fingerprint": fingerprint,
            "ledger": ledger.state_dict() if ledger is not None else None,
            "last_metrics": dict(last_metrics),
        })

    def _check_resumable(self, state: dict, fingerprint: dict) -> None:
        """Refuse a checkpoint that this configuration cannot continue (nothing is written before).

        Raises
        ------
        ConfigError
            When a setting the accounting depends on changed, or ``run.rounds`` is below the
            rounds already completed.
        RfedrayError
            When the checkpoint's model does not fit the configured model or is not finite.
        """
        rd = self.run_dir
        before, now = _flatten(state.get("fingerprint") or {}), _flatten(fingerprint)
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if changed:
            details = "; ".join(
                f"{k}: {FINGERPRINT_NOTES[k]}" if k in FINGERPRINT_NOTES else f"{k} was {before.get(k)!r}, now {now.get(k)!r}"
                for k in changed
            )
            raise ConfigError(
                changed[0], "changed since the checkpoint",
                f"a resumed run must keep every setting the privacy accounting depends on ({details}); "
                "resume with the original values, or start a new run",
            )
        done = state["round"]
        if isinstance(done, bool) or not isinstance(done, int) or done < 0:
            raise RfedrayError(f"--resume {rd.path}: checkpoint.pt records round {done!r}, not a round count; "
                               "it is damaged: restore it from a backup or start a new run")
        if done > self.cfg.run.rounds:
            raise ConfigError("run.rounds", self.cfg.run.rounds,
                              f"the run has already completed {done} rounds; resume with run.rounds >= {done}")
        theta = state["theta"]
        expected = {k: tuple(v.shape) for k, v in initial_params(self.cfg, self.model).items()}
        found = ({k: tuple(v.shape) for k, v in theta.items() if isinstance(v, torch.Tensor)}
                 if isinstance(theta, dict) else None)
        if found != expected:
            raise RfedrayError(
                f"--resume {rd.path}: checkpoint.pt holds a model of shapes {found}, the configuration builds "
                f"{expected}; resume with the configuration the run was started with (its config.yaml)"
            )
        if not all(bool(torch.isfinite(v).all()) for v in theta.values()):
            raise RfedrayError(f"--resume {rd.path}: checkpoint.pt holds a model that is not finite; "
                               "it is damaged: restore it from a backup or start a new run")

    def _saved_budget(self, fingerprint: dict) -> Optional[dict]:
        """The write-ahead ledger of ``budget.json``, or None when there is none.

        Raises
        ------
        RfedrayError
            When ``budget.json`` is unreadable or was written for another accounting set-up.
        """
        rd = self.run_dir
        if not rd.budget.is_file():
            return None
        try:
            saved = json.loads(rd.budget.read_text())
        except (OSError, ValueError) as exc:
            raise RfedrayError(
                f"--resume {rd.path}: budget.json is unreadable ({type(exc).__name__}); it records the privacy "
                "budget spent, so the run cannot continue without it: restore it from a backup"
            ) from None
        if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint or "ledger" not in saved:
            raise RfedrayError(
                f"--resume {rd.path}: budget.json was not written for this run's accounting set-up "
                "(its fingerprint differs from the checkpoint's); restore the run's own budget.json from a backup"
            )
        return saved

    def _load_ledger(self, ledger, state: dict, fingerprint: dict) -> None:
        """Load the spent budget into ``ledger``: ``budget.json``, else the checkpoint's copy.

        The write-ahead ledger may be ahead of the checkpoint (rounds charged, then lost): it is
        the one to keep, so a resumed run never reports less than was spent.
        """
        saved = self._saved_budget(fingerprint) or {"ledger": state["ledger"]}
        try:
            ledger.load_state_dict(saved["ledger"])
        except (RfedrayError, KeyError, TypeError, AttributeError) as exc:
            raise RfedrayError(
                f"--resume {self.run_dir.path}: the saved privacy ledger does not fit this run ({type(exc).__name__}: {exc}); "
                "restore budget.json from a backup (never delete it: it records the budget spent)"
            ) from None

    def check_resume(self) -> dict[str, Any]:
        """Check, writing nothing, that this configuration can resume the run directory; its checkpoint.

        Everything a resume checks before it touches the run directory: the checkpoint (readable,
        same accounting, same model, finite, not past ``run.rounds``), ``budget.json`` and
        ``metrics.jsonl``. An engine that starts other processes (Ray) calls it first, so that a
        run directory that cannot be resumed is refused before anything starts.

        Raises
        ------
        RfedrayError
            (or its :class:`ConfigError`) naming the file or the setting, and what to do.
        """
        state = self.run_dir.read_checkpoint()
        fingerprint = accounting_fingerprint(self.cfg, self.privacy, self.sizes)
        self._check_resumable(state, fingerprint)
        ledger = self.make_ledger()
        if ledger is not None:
            self._load_ledger(ledger, state, fingerprint)
        self.run_dir.metrics_before(state["round"])
        return state

    def _start_state(self, ledger, fingerprint: dict, resume: bool) -> dict[str, Any]:
        rd = self.run_dir
        if not resume:
            # The saved config carries the resolved sigma, so a resume (even one that extends
            # run.rounds) keeps the mechanism the ledger was charged for.
            resolved = replace(self.cfg, privacy=replace(self.cfg.privacy, sigma=self.privacy.sigma))
            rd.config.write_text(to_yaml(resolved))
            theta = initial_params(self.cfg, self.model)
            return {"theta": theta, "round": 0, "optimizer_states": {}, "counters": {"client_failures": 0, "submissions_rejected": 0}}
        state = self.check_resume()
        if ledger is not None:
            self._load_ledger(ledger, state, fingerprint)
        rd.truncate_metrics(state["round"])
        rd.append_metrics({"event": "resumed", "round": state["round"], "epsilon_spent": ledger.epsilon_spent() if ledger else None})
        return state


def run_federation(cfg: Config, run_dir: RunDirectory, observers: Optional[list] = None,
                   executor_factory: Optional[Callable[[Federation], Executor]] = None, resume: bool = False) -> dict:
    """Prepare and run a federation with the local executor (or the one ``executor_factory`` makes)."""
    fed = Federation.prepare(cfg, run_dir, observers)
    executor = executor_factory(fed) if executor_factory is not None else fed.local_executor()
    try:
        return fed.run(executor, resume=resume)
    finally:
        executor.close()


