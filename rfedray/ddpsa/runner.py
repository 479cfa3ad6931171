"""A DDP-SA federation: private client steps, secret-shared updates, server steps on the sum only.

Round ``t`` (on the federation loop, :mod:`rfedray.federated.rounds`; :class:`DDPSARound`):

1. the cohort is drawn; the ledger (Laplace accountant) is charged for one step of every member
   (write-ahead); a round that would pass the target epsilon is not run;
2. every client runs :class:`DDPSATask`: one DDP-SA step (:mod:`rfedray.ddpsa.mechanism`), then it
   encodes and secret-shares the privatised gradient to the aggregators
   (:mod:`rfedray.ddpsa.secure_aggregation`); only a receipt with telemetry comes back;
3. the server collects the sum over the clients whose every share arrived (dropouts are
   discarded consistently) and steps ``theta <- theta - lr * sum / |P|``;
4. it evaluates on the test set and stops early once the test loss has not improved by a relative
   ``min_delta`` for ``patience`` rounds (the "rounds to convergence" the paper compares).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from rfedray.ddpsa.mechanism import ClipPolicy, ddpsa_step, layers_of
from rfedray.ddpsa.secure_aggregation import AggregatorGroup, FixedPointCodec, collect_sum, send_update
from rfedray.federated.client import ClientFailure, round_generator
from rfedray.federated.engine import Engine, HostedClient, check_task_run
from rfedray.federated.rounds import Strategy
from rfedray.federated.task_rounds import run_task_rounds
from rfedray.mestimation.local import ParamLayout, StepPlan
from rfedray.privacy import checks
from rfedray.privacy.accountants import LaplaceAccountant, LaplaceStep, calibrate_noise
from rfedray.privacy.gdp import gdp_mu
from rfedray.privacy.plan import LaplaceMechanism, PrivacyPlan
from rfedray.task import FederatedDataset, FederatedModel, Params, initial_theta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DDPSATask:
    """The client side of a round (picklable: the aggregator group is local objects or actor handles)."""

    plan: StepPlan
    policy: ClipPolicy
    codec: FixedPointCodec
    aggregators: AggregatorGroup

    def __call__(self, client: HostedClient, theta: Params, round_index: int) -> dict:
        gen = round_generator(self.plan.noise_seed, client.client_id, round_index)
        batch = self.plan.batch(client.data.train, gen)
        release = ddpsa_step(client.model.per_sample_loss, theta, batch, self.policy, client.state,
                             self.plan.noise_multiplier, gen)
        vector = ParamLayout.of(theta).flatten(release.gradient).detach().double().numpy()
        share_rng = None
        if self.plan.noise_seed is not None:
            share_rng = np.random.default_rng(np.random.SeedSequence(self.plan.noise_seed, spawn_key=(0x5A, client.client_id, round_index)))
        send_update(self.aggregators, self.codec, round_index, client.client_id, vector, share_rng)
        return {"clips": release.clips, "noise_scales": release.noise_scales, **release.diagnostics}


class DDPSARound(Strategy):
    """A DDP-SA round on the federation loop: every client of the cohort
    runs :class:`DDPSATask` on the engine (one step, secret-shared to the aggregators); the server
    steps ``theta <- theta - lr * sum / |P|`` on the secure sum, evaluates, and ends the run once
    the test loss has not improved by a relative ``min_delta`` for ``patience`` rounds.
    """

    def __init__(self, task: DDPSATask, engine: Engine, model: FederatedModel, eval_data, lr: float,
                 min_clients: int, patience: int, min_delta: float):
        self.task, self.engine, self.model, self.eval_data, self.lr = task, engine, model, eval_data, lr
        self.min_clients, self.patience, self.min_delta = min_clients, patience, min_delta
        self.best, self.since_best = float("inf"), 0

    def round(self, chosen: list[int], theta: Params, t: int) -> tuple[Params, dict]:
        receipts = self.engine.run(chosen, self.task, theta, t)
        secure = collect_sum(self.task.aggregators, self.task.codec, t, self.min_clients)
        if secure.total is not None:
            layout, dtype = ParamLayout.of(theta), next(iter(theta.values())).dtype
            mean = layout.unflatten(torch.as_tensor(secure.total / len(secure.participants), dtype=dtype))
            theta = {k: theta[k] - self.lr * mean[k] for k in theta}
        answered = [r for r in receipts.values() if not isinstance(r, ClientFailure)]
        return theta, {
            "covered": self.task.policy.covered, "participants": len(secure.participants),
            "dropped": len(secure.dropped), "failed": len(chosen) - len(answered), "aggregated": secure.total is not None,
            "mean_clip": _mean_over(answered, "clips"), "mean_noise_scale": _mean_over(answered, "noise_scales"),
            **self.model.evaluate(theta, self.eval_data),
        }

    def stop(self, record: dict) -> bool:
        """Early stopping: ``patience`` rounds without a relative improvement of ``min_delta`` in the test loss."""
        if record["loss"] < self.best * (1 - self.min_delta):
            self.best, self.since_best = record["loss"], 0
        else:
            self.since_best += 1
        return self.since_best >= self.patience


def step_ratio(policy: ClipPolicy, num_layers: int, noise_multiplier: float) -> float:
    """L1 sensitivity-to-scale ratio of one step: ``L / z`` for the gradient, over ``1 - phi`` for the policy's share."""
    return num_layers / (noise_multiplier * (1.0 - policy.budget_share))


def calibrate_ddpsa(policy: ClipPolicy, num_layers: int, epsilon: float, delta: float, steps: int,
                    batch_size: int, records: int) -> float:
    """The noise multiplier ``z`` meeting ``(epsilon, delta)`` after ``steps`` steps (Laplace accountant).

    The search is on ``b``, the Laplace scale of a mean of ``B`` records clipped to L1 norm 1 (ratio
    ``2 / (B b)``, start ``2 sqrt(steps) / (m mu)`` as for the Gaussian); the step's ratio is then
    ``L / (z (1 - phi))`` (:func:`step_ratio`).
    """
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    batch_size, records = checks.batch_within(batch_size, records)
    scale = calibrate_noise(
        LaplaceAccountant(), lambda b: LaplaceStep(2.0 / (batch_size * b), batch_size / records),
        epsilon=epsilon, delta=delta, rounds=steps, local_steps=1,
        start=2.0 * math.sqrt(steps) / (records * gdp_mu(epsilon, delta)),
    )
    total = 2.0 / (batch_size * scale)
    return num_layers / ((1.0 - policy.budget_share) * total)


def run_ddpsa(policy: ClipPolicy, engine: Engine, aggregators: AggregatorGroup, model: FederatedModel,
              dataset: FederatedDataset, *, rounds: int, clients_per_round: int, batch_size: int, lr: float,
              epsilon: Optional[float], delta: float = 1e-5, noise_multiplier: Optional[float] = None,
              codec: FixedPointCodec = FixedPointCodec(), min_clients: int = 2, patience: int = 10,
              min_delta: float = 1e-3, seed: int = 0, noise_seed: Optional[int] = None,
              on_round: Optional[Callable[[dict], None]] = None) -> dict:
    """Run DDP-SA with ``policy``; return ``{"history", "summary", "theta"}``.

    Parameters
    ----------
    policy : ClipPolicy
        StaticClip (DDP-SA), MedianClip (DDP-SA-adaptive as published, not covered: the run warns,
        and every record and the summary say ``covered: false``) or PrivateQuantileClip (covered).
    engine : Engine
    aggregators : AggregatorGroup
    model, dataset
    rounds : int
        Largest number of rounds.
    clients_per_round, batch_size : int
    lr : float
        Server step size, > 0.
    epsilon : float or None
        Target (``z`` calibrated to it for ``rounds`` steps); ``None`` with ``noise_multiplier=None``
        is the non-private run.
    delta : float
    noise_multiplier : float or None
        A given ``z`` (skips calibration).
    codec : FixedPointCodec
    min_clients : int
        Fewest complete clients the secure sum accepts (>= 2).
    patience, min_delta
        Early stopping on the test loss.
    seed, noise_seed : int
    on_round : callable, optional
    """
    sizes = dataset.client_sizes()
    check_task_run(sizes, clients_per_round, batch_size, rounds, fewest=2)  # secure aggregation needs 2
    if not lr > 0:
        raise ValueError(f"lr={lr}: must be > 0")
    if patience < 1:
        raise ValueError(f"patience={patience}: must be >= 1")
    if not policy.covered:
        log.warning("ddpsa.clipping=%s is NOT covered by the record-level guarantee: its clip thresholds are "
                    "unprivatised functions of the records that the run releases; its epsilon is nominal "
                    "(use ddpsa.clipping=private_quantile)", policy.name)
    theta = initial_theta(model, seed)
    num_layers = len(layers_of(theta))
    mechanism = None
    if epsilon is not None or noise_multiplier is not None:
        if noise_multiplier is None:
            noise_multiplier = calibrate_ddpsa(policy, num_layers, epsilon, delta, rounds, batch_size, min(sizes))
        policy = policy.bind(noise_multiplier)
        mechanism = LaplaceMechanism(step_ratio(policy, num_layers, noise_multiplier), batch_size)
    plan = PrivacyPlan(mechanism, "laplace", delta, epsilon, local_steps=1, noise_seed=noise_seed)
    task = DDPSATask(StepPlan(batch_size, 1.0, noise_multiplier, noise_seed), policy, codec, aggregators)
    round_ = DDPSARound(task, engine, model, dataset.eval_data(), lr, min_clients, patience, min_delta)
    outcome, summary = run_task_rounds(round_, plan, theta, sizes, rounds=rounds, seed=seed,
                                       clients_per_round=clients_per_round, on_round=on_round)
    last = outcome.records[-1] if outcome.records else {}
    summary.update({
        **policy.describe(), "covered": policy.covered,
        "guarantee": "covered" if policy.covered else
                     "NOT covered: clip thresholds are unprivatised medians of the records; epsilon is nominal",
        "stopped_early": outcome.stopped_early, "noise_multiplier": noise_multiplier,
        "seconds_per_round": summary["wall_seconds"] / max(len(outcome.records), 1),
        "final_metrics": {k: last[k] for k in ("loss", "r2", "param_error") if k in last},
        "secure_aggregation": {"aggregators": aggregators.num_aggregators, "frac_bits": codec.frac_bits,
                               "max_parties": codec.max_parties, "min_clients": min_clients},
    })
    return {"history": outcome.records, "summary": summary, "theta": outcome.theta}


def _mean_over(receipts: list[dict], key: str) -> Optional[float]:
    values = [v for r in receipts for v in r.get(key, {}).values()]
    return float(np.mean(values)) if values else None
