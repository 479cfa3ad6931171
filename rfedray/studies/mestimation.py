"""Study: private federated M-estimation (Auddy, Peng and Paul), error against rounds and epsilon.

``run_study(out_dir, scale)`` runs DP-FedSGD, DP-FedAvg, DP-FedHybrid and DP-FedNewton on binary
logistic regression over IID clients of a synthetic logistic model (many records per client, the
regime the paper's Newton claim is about), with few and with many clients, and writes:

- ``rounds.csv``: relative error ``||theta_t - theta_hat|| / ||theta_hat||`` per round (``theta_hat``
  the pooled non-private M-estimator, a simulation oracle), per strategy, client count and epsilon;
- ``epsilon.csv``: final error per strategy and epsilon;
- ``claims.json``: the two qualitative claims as measured (they may fail: reported, not asserted);
- ``error_vs_rounds.png``, ``error_vs_epsilon.png`` and ``report.md``.

Every private run calibrates its own noise multiplier to its total number of private steps with
the project's exact Gaussian accountant and is charged step by step to a ledger.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rfedray.federated.engine import LocalEngine, TaskSpec
from rfedray.mestimation.runner import pooled_m_estimator, run_strategy
from rfedray.mestimation.strategies import FedAvg, FedHybrid, FedNewton, FedSGD
from rfedray.studies.base import pyplot, save_figure, study_folder, write_csv

SCALES = {
    "tiny": {"records": 1500, "few": 3, "many": 12, "rounds": 15, "newton_rounds": 4, "epsilons": [2.0, 8.0, None],
             "rounds_epsilon": 8.0},
    "full": {"records": 5000, "few": 3, "many": 30, "rounds": 40, "newton_rounds": 6,
             "epsilons": [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, None], "rounds_epsilon": 4.0},
}
LR = 4.0


def strategies(rounds: int, newton_rounds: int) -> dict:
    """The four strategies and their round budgets (FedHybrid switches after a third of them)."""
    return {
        "fedsgd": (FedSGD(LR), rounds),
        "fedavg": (FedAvg(10, LR), rounds),
        "fedhybrid": (FedHybrid(FedAvg(10, LR), FedSGD(LR), max(1, rounds // 3)), rounds),
        "fednewton": (FedNewton(floor=0.02), newton_rounds),
    }


def _task(n_clients: int, records_total: int, seed: int):
    spec = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                    {"dataset": "synthetic_logistic", "records_per_client": records_total // n_clients, "d": 10,
                     "partition": "iid"}, {"l2": 1e-3}, n_clients, seed)
    dataset = spec.build_dataset()
    model = spec.build_model(dataset.info)
    return dataset, model, pooled_m_estimator(model, dataset.pooled_train())


def _label(eps) -> str:
    return "inf" if eps is None else f"{eps:g}"


def rounds_to_reach(history: list[dict], target: float):
    """First round (1-based) whose error is at most ``target``; None if never."""
    return next((r["round"] + 1 for r in history if r.get("oracle_error", math.inf) <= target), None)


def run_study(out_dir, scale: str = "tiny") -> dict:
    """Run the study at ``scale`` ("tiny": about a minute; "full": longer) and write its files."""
    s, out = study_folder(SCALES, scale, out_dir)
    total_records = s["records"] * s["few"]
    rows, finals = [], []
    histories: dict = {}
    for clients in ("few", "many"):
        n = s[clients]
        dataset, model, ref = _task(n, total_records, 0)
        batch = min(dataset.client_sizes())
        for eps in sorted(set(s["epsilons"] + [s["rounds_epsilon"]]), key=lambda e: math.inf if e is None else e):
            if clients == "many" and eps not in (s["rounds_epsilon"], None):
                continue
            for name, (strategy, rounds) in strategies(s["rounds"], s["newton_rounds"]).items():
                result = run_strategy(strategy, LocalEngine(dataset, model), model, dataset, rounds=rounds,
                                      clients_per_round=n, batch_size=batch, epsilon=eps,
                                      noise_seed=11 if eps is not None else None, reference=ref)
                histories[(clients, _label(eps), name)] = result["history"]
                for r in result["history"]:
                    rows.append({"clients": n, "epsilon": _label(eps), "strategy": name, "round": r["round"] + 1,
                                 "error": r["oracle_error"], "accuracy": r["accuracy"]})
                finals.append({"clients": n, "epsilon": _label(eps), "strategy": name, "rounds": rounds,
                               "final_error": result["history"][-1]["oracle_error"],
                               "accuracy": result["history"][-1]["accuracy"],
                               "noise_multiplier": result["summary"]["noise_multiplier"],
                               "epsilon_spent": result["summary"]["epsilon_spent"]})
    write_csv(out / "rounds.csv", rows)
    write_csv(out / "epsilon.csv", finals)
    claims = _claims(histories, finals, s)
    (out / "claims.json").write_text(json.dumps(claims, indent=2))
    _plots(out, histories, finals, s)
    _report(out, claims, finals, scale)
    return {"claims": claims, "finals": finals, "files": sorted(p.name for p in out.iterdir())}


def _claims(histories, finals, s) -> dict:
    claims = {}
    for clients in ("few", "many"):
        for eps in (None, s["rounds_epsilon"]):
            sgd = histories[(clients, _label(eps), "fedsgd")]
            newton = histories[(clients, _label(eps), "fednewton")]
            target = sgd[-1]["oracle_error"]
            claims[f"newton_vs_sgd_{clients}_clients_eps_{_label(eps)}"] = {
                "fedsgd_rounds": len(sgd), "fedsgd_final_error": target,
                "fednewton_rounds_to_reach_it": rounds_to_reach(newton, target),
                "fednewton_best_error": min(r["oracle_error"] for r in newton),
                "holds": rounds_to_reach(newton, target) is not None and rounds_to_reach(newton, target) < len(sgd) / 2,
            }
            avg = histories[(clients, _label(eps), "fedavg")][-1]["oracle_error"]
            hybrid = histories[(clients, _label(eps), "fedhybrid")][-1]["oracle_error"]
            claims[f"hybrid_vs_avg_{clients}_clients_eps_{_label(eps)}"] = {
                "fedavg_final_error": avg, "fedhybrid_final_error": hybrid, "holds": hybrid < avg}
    return claims


def _plots(out: Path, histories, finals, s) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, clients in zip(axes, ("few", "many")):
        for (c, eps, name), hist in histories.items():
            if c == clients and eps == _label(s["rounds_epsilon"]):
                ax.semilogy([r["round"] + 1 for r in hist], [r["oracle_error"] for r in hist], marker="o", ms=3, label=name)
        ax.set_title(f"{s[clients]} clients, epsilon = {s['rounds_epsilon']:g}")
        ax.set_xlabel("communication round")
        ax.legend()
    axes[0].set_ylabel("relative error to pooled M-estimator")
    save_figure(fig, out / "error_vs_rounds.png")
    fig, ax = plt.subplots(figsize=(5, 4))
    few = [f for f in finals if f["clients"] == s["few"]]
    for name in ("fedsgd", "fedavg", "fedhybrid", "fednewton"):
        pts = [(float(f["epsilon"]) if f["epsilon"] != "inf" else 2 * max(e for e in s["epsilons"] if e), f["final_error"])
               for f in few if f["strategy"] == name]
        pts.sort()
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("epsilon (rightmost point: non-private)")
    ax.set_ylabel("final relative error")
    ax.set_title(f"{s['few']} clients")
    ax.legend()
    save_figure(fig, out / "error_vs_epsilon.png")


def _report(out: Path, claims: dict, finals: list[dict], scale: str) -> None:
    lines = [f"# Private federated M-estimation ({scale})", "",
             "Binary logistic regression on a synthetic logistic model, IID clients, delta = 1e-5, exact "
             "Gaussian accountant (a Newton step's gradient+Hessian pair priced as one step). Error: "
             "||theta - theta_hat|| / ||theta_hat||, theta_hat the pooled non-private M-estimator.", "",
             "| clients | epsilon | strategy | rounds | final error | accuracy | z |", "|---|---|---|---|---|---|---|"]
    for f in finals:
        z = "-" if f["noise_multiplier"] is None else f"{f['noise_multiplier']:.3g}"
        lines.append(f"| {f['clients']} | {f['epsilon']} | {f['strategy']} | {f['rounds']} | {f['final_error']:.4f} | "
                     f"{f['accuracy']:.3f} | {z} |")
    lines += ["", "## Claims as measured", ""]
    for key, value in claims.items():
        lines.append(f"- `{key}`: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items()))
    (out / "report.md").write_text("\n".join(lines) + "\n")


class MEstimationStudy:
    """``rfedray experiment mestimation``: the M-estimation strategies against rounds and epsilon."""

    name = "mestimation"
    description = "Auddy-Peng-Paul: DP-FedSGD/FedAvg/FedHybrid/FedNewton error vs rounds and epsilon"
    laptop_minutes = {"tiny": 1, "full": 20}

    def run(self, out: Path, scale: str, workers=None) -> Path:
        run_study(out, scale)
        return Path(out) / "report.md"
