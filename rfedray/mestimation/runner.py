"""Run one M-estimation strategy: calibrate the noise, then its rounds on the federation loop
(:mod:`rfedray.federated.rounds`; :class:`MEstimationRound`).

Every participant of round ``t`` releases ``strategy.steps(t)`` private steps, each the same
Gaussian mechanism (noise multiplier ``z``, minibatch ``B`` of its ``m`` records; a Newton step is
priced as one step, see :mod:`rfedray.mestimation.local`). The ledger is the project's
:class:`rfedray.privacy.ledger.PrivacyLedger` of the run's privacy plan, one step per
charge; it is charged for every step of the round *before* the clients run (write-ahead), and a
round that would pass the target epsilon is not run. ``z`` is calibrated by the project's
``calibrate_sigma`` for the worst client (smallest ``m``, taking part in every round).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch

from rfedray.federated.client import ClientFailure
from rfedray.federated.engine import Engine, check_task_run
from rfedray.federated.rounds import Strategy as RoundStrategy
from rfedray.federated.task_rounds import run_task_rounds
from rfedray.mestimation.local import ParamLayout, StepPlan
from rfedray.mestimation.strategies import FedNewton, Strategy
from rfedray.privacy.plan import GaussianMechanism, PrivacyPlan
from rfedray.task import FederatedDataset, FederatedModel, Params, initial_theta


def calibrate_multiplier(accountant: str, epsilon: float, delta: float, total_steps: int, batch_size: int,
                         records: int) -> float:
    """The noise multiplier such that ``total_steps`` steps on the smallest client (``records``) spend ``epsilon``."""
    from rfedray.privacy.accountants import ACCOUNTANTS, calibrate_sigma

    return float(calibrate_sigma(ACCOUNTANTS[accountant](), epsilon=epsilon, delta=delta, rounds=total_steps,
                                 local_steps=1, batch_size=batch_size, records=records, clip=1.0))


def pooled_m_estimator(model: FederatedModel, data: tuple[torch.Tensor, ...]) -> Params:
    """The non-private pooled M-estimator (minimiser of the mean loss over ``data``), by L-BFGS to a
    gradient tolerance of 1e-10 (at most 5000 iterations).

    A simulation oracle (it reads every client's records): the reference the estimation error
    is measured against.
    """
    from scipy.optimize import minimize

    theta = model.init_params(torch.Generator().manual_seed(0))
    layout = ParamLayout.of(theta)
    batched = torch.func.vmap(model.per_sample_loss, in_dims=(None,) + (0,) * len(data))

    def value_and_grad(vec: np.ndarray) -> tuple[float, np.ndarray]:
        v = torch.as_tensor(vec, dtype=torch.float64).requires_grad_(True)
        loss = batched(layout.unflatten(v.to(layout_dtype)), *data).mean()
        (grad,) = torch.autograd.grad(loss, v)
        return float(loss.detach()), grad.numpy()

    layout_dtype = next(iter(theta.values())).dtype
    start = layout.flatten(theta).double().numpy()
    result = minimize(value_and_grad, start, jac=True, method="L-BFGS-B",
                      options={"maxiter": 5000, "gtol": 1e-10, "ftol": 0.0, "maxcor": 30})
    return layout.unflatten(torch.as_tensor(result.x, dtype=layout_dtype))


def relative_error(theta: Params, reference: Params) -> float:
    """``||theta - ref|| / ||ref||`` over all parameters."""
    num = sum(float(((theta[k].double() - reference[k].double()) ** 2).sum()) for k in reference)
    den = sum(float((reference[k].double() ** 2).sum()) for k in reference)
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


class MEstimationRound(RoundStrategy):
    """A round of an M-estimation strategy on the federation loop: every
    client of the cohort runs the strategy's task (``strategy.steps(t)`` private steps) on the
    engine, and the strategy combines the finite answers; evaluated every ``evaluate_every`` rounds.

    Parameters
    ----------
    strategy : Strategy
        FedSGD, FedAvg, FedHybrid or FedNewton.
    engine : Engine
    plan : StepPlan
    model, eval_data
    reference : dict of Tensor or None
        Adds ``oracle_error`` to every evaluated round.
    evaluate_every, rounds : int
    """

    def __init__(self, strategy: Strategy, engine: Engine, plan: StepPlan, model: FederatedModel, eval_data,
                 reference: Optional[Params], evaluate_every: int, rounds: int):
        self.strategy, self.engine, self.plan, self.model, self.eval_data = strategy, engine, plan, model, eval_data
        self.reference, self.evaluate_every, self.rounds = reference, evaluate_every, rounds
        self.failures = 0

    def participations(self, t: int) -> int:
        return self.strategy.steps(t)

    def round(self, chosen: list[int], theta: Params, t: int) -> tuple[Params, dict]:
        results = self.engine.run(chosen, self.strategy.task(self.plan, t), theta, t)
        usable = [r for r in results.values()
                  if not isinstance(r, ClientFailure) and all(bool(torch.isfinite(v).all()) for v in r.values())]
        self.failures += len(chosen) - len(usable)
        if usable:
            theta = self.strategy.aggregate(theta, usable, t)
        report = {"answered": len(usable), "steps": self.strategy.steps(t)}
        if (t + 1) % self.evaluate_every == 0 or t + 1 == self.rounds:
            report.update(self.eval_data.labelled(self.model.evaluate(theta, self.eval_data)))
            if self.reference is not None:
                report["oracle_error"] = relative_error(theta, self.reference)
        return theta, report


def run_strategy(strategy: Strategy, engine: Engine, model: FederatedModel, dataset: FederatedDataset, *,
                 rounds: int, clients_per_round: int, batch_size: int, epsilon: Optional[float] = None,
                 delta: float = 1e-5, clip: float = 1.0, noise_multiplier: Optional[float] = None,
                 accountant: str = "exact", noise_seed: Optional[int] = None, seed: int = 0,
                 reference: Optional[Params] = None, evaluate_every: int = 1,
                 on_round: Optional[Callable[[dict], None]] = None) -> dict:
    """Run ``rounds`` rounds and return ``{"history", "summary", "theta"}``.

    Parameters
    ----------
    strategy : Strategy
    engine : Engine
        Local or Ray; runs the clients' tasks.
    model, dataset
    rounds, clients_per_round, batch_size : int
    epsilon : float or None
        Target epsilon (``z`` is calibrated to it); ``None`` with ``noise_multiplier=None`` runs
        without privacy.
    delta, clip : float
        delta, and the per-record gradient clip C.
    noise_multiplier : float or None
        A given ``z`` (skips calibration).
    accountant : str
        A key of :data:`rfedray.privacy.accountants.UPPER_BOUNDS` (one that bounds epsilon from above).
    noise_seed : int or None
        Reproducible noise (not for production).
    seed : int
        Seeds the initial model and the (public) cohorts.
    reference : dict of Tensor, optional
        Target estimator, e.g. the pooled M-estimator (a simulation oracle: it reads every client's
        records); adds ``oracle_error`` (relative) to every evaluated round.
    evaluate_every : int
    on_round : callable, optional
        Receives every round's record.
    """
    sizes = dataset.client_sizes()
    check_task_run(sizes, clients_per_round, batch_size, rounds)
    theta = initial_theta(model, seed)
    if isinstance(strategy, FedNewton):
        strategy.check_model(theta)
    total_steps = strategy.total_steps(rounds)
    if noise_multiplier is None and epsilon is not None:
        noise_multiplier = calibrate_multiplier(accountant, epsilon, delta, total_steps, batch_size, min(sizes))
    # Every step a Gaussian mechanism of clip C and noise std noise_multiplier * C, one step per charge
    # (a round charges strategy.steps).
    mechanism = None if noise_multiplier is None else GaussianMechanism(noise_multiplier * clip, clip, batch_size)
    plan = PrivacyPlan(mechanism, accountant, delta, epsilon, local_steps=1, noise_seed=noise_seed)
    eval_data = dataset.eval_data()
    step = StepPlan(batch_size, clip, noise_multiplier, noise_seed)
    round_ = MEstimationRound(strategy, engine, step, model, eval_data, reference, evaluate_every, rounds)
    outcome, summary = run_task_rounds(round_, plan, theta, sizes, rounds=rounds, seed=seed,
                                       clients_per_round=clients_per_round, on_round=on_round)
    last = next((r for r in reversed(outcome.records) if "loss" in r or "oracle_loss" in r), {})
    summary.update({
        **strategy.describe(), "private_steps_per_client": total_steps, "noise_multiplier": noise_multiplier,
        "clip": plan.clip,
        "client_failures": round_.failures,
        "final_metrics": {k: v for k, v in last.items()
                          if k.removeprefix("oracle_") in ("loss", "accuracy", "r2", "error", "param_error")},
        "oracle_metrics": eval_data.oracle or reference is not None,
    })
    return {"history": outcome.records, "summary": summary, "theta": outcome.theta}
