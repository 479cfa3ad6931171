"""The synthetic federated-PCA studies of the paper (Figure 2, Tables 9 and 10).

All runs use the paper's Table 4 setting at ``scale="full"`` (n=50, k=10, m=5000, tau=10, B=500,
T=200, epsilon=1, delta=1e-5, step size 0.2) and a much smaller one at ``scale="tiny"`` (for CI).

"Cost of privacy" (Table 9) is read here as the median over seeds of the paired difference
``gap(private) - gap(non-private)`` at the same seed (same data, same cohorts); the report also
gives the difference of the medians, and the paper's predicted term ``eta sigma^2 d_M / k``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from rfedray.privacy.paper import PAPER_CLIP as FITTED_CLIP
from rfedray.studies import paper
from rfedray.studies.base import Row, Table, fmt_median, median_iqr, pyplot, run_grid, save_figure, write_outputs


@dataclass(frozen=True)
class Scale:
    n: int
    k: int
    m: int
    tau: int
    batch: int
    rounds: int
    seeds: int


SCALES = {
    "full": Scale(n=50, k=10, m=5000, tau=10, batch=500, rounds=200, seeds=10),
    "tiny": Scale(n=6, k=3, m=200, tau=2, batch=20, rounds=8, seeds=2),
}


def base_overrides(scale: Scale, seed: int, d: int, p: int) -> list[str]:
    return [
        "run.name=fedpca-study", f"run.seed={seed}", f"privacy.noise_seed={seed}", f"run.rounds={scale.rounds}",
        f"run.checkpoint_every={scale.rounds}", f"federation.n_clients={scale.n}", f"federation.clients_per_round={scale.k}",
        f"federation.local_steps={scale.tau}", f"federation.batch_size={scale.batch}",
        f"data.options.records_per_client={scale.m}", f"data.options.d={d}", f"data.options.p={p}",
        f"privacy.clip={FITTED_CLIP}", "privacy.delta=1e-5", "optim.default.lr=0.2", "run.evaluate_every=1000000",
        "run.test_set=server",  # the oracle gap (the simulation's server holds the pooled covariance)
    ]


def _seed_gaps(summaries: dict, key: tuple, seeds: int) -> list[float]:
    """The final optimality gap of the job ``(*key, seed)`` for every seed."""
    return [summaries[(*key, s)]["final_metrics"]["oracle_gap"] for s in range(seeds)]


def _figure(path: Path, xs, series: dict[str, list], xlabel: str, ylabel: str, title: str, logy: bool = False,
            paper_series: Optional[dict[str, list]] = None) -> str:
    """Median and IQR per series against ``xs``; ``paper_series`` (same names) as crosses."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    for offset, (name, triples) in enumerate(series.items()):
        med = [t[0] for t in triples]
        lo = [t[0] - t[1] for t in triples]
        hi = [t[2] - t[0] for t in triples]
        shift = [x * (1 + 0.01 * offset) for x in xs]
        line = ax.errorbar(shift, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
        if paper_series and name in paper_series:
            ax.plot(shift, paper_series[name], "x", ms=8, color=line[0].get_color(), label=f"{name} (paper)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _figure_dimension(path: Path, rows: Sequence[Row]) -> str:
    """Figure 2 (a) cost against the intrinsic dimension at d = 40, and (b) against the ambient
    dimension D at the same d_M = 144: ours (median and IQR), the paper's medians, and the
    stationary value eta sigma^2 d_M / (4k)."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(8.6, 3.4))
    panels = (("a", "d_M", "intrinsic dimension d_M (d = 40)", lambda r: r.label["d"] == 40),
              ("b", "D", "ambient dimension D = d(d+1)/2 (d_M = 144)", lambda r: r.label["d_M"] == 144))
    for ax, (panel, axis, xlabel, keep) in zip(axes, panels):
        chosen = sorted((r for r in rows if keep(r)), key=lambda r: r.label[axis])
        xs = [r.label[axis] for r in chosen]
        for offset, (label, colour) in enumerate((("ProjAvg", "C0"), ("RLAvg", "C1"))):
            shift = [x * (1 + 0.012 * offset) for x in xs]
            med = [r.ours[label][0] for r in chosen]
            err = [[r.ours[label][0] - r.ours[label][1] for r in chosen], [r.ours[label][2] - r.ours[label][0] for r in chosen]]
            ax.errorbar(shift, med, yerr=err, marker="o", capsize=3, color=colour, label=f"{label} (ours)")
            ax.plot(shift, [r.paper[label] for r in chosen], "x", color=colour, ms=8, label=f"{label} (paper)")
        ax.plot(xs, [r.ours["eta sigma^2 d_M / (4k) (1e-4)"] for r in chosen], "k--", lw=1,
                label="eta sigma^2 d_M / (4k)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("cost of privacy (1e-4)")
        ax.set_title(f"Figure 2({panel})", fontsize=10)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    return save_figure(fig, path)


class FedPCAStudy:
    """What the federated-PCA studies take besides a scale: fewer seeds, and config overrides for every run."""

    accepts_seeds = True
    accepts_overrides = True


class FedPCADimension(FedPCAStudy):
    """Figure 2 (a, b) and Table 9: the cost of privacy against intrinsic and ambient dimension."""

    name = "fedpca-dimension"
    description = "Table 9 / Figure 2(a,b): cost of privacy vs intrinsic (p(d-p)) and ambient dimension"
    laptop_minutes = {"tiny": 1, "full": 20}

    def run(self, out: Path, scale: str, workers=None, seeds=None, overrides=()) -> Path:
        sc = replace(SCALES[scale], seeds=seeds or SCALES[scale].seeds)
        settings = [(row[1], row[2]) for row in paper.TABLE9]
        settings = list(dict.fromkeys(settings))
        jobs = {
            (d, p, scheme, private, seed): base_overrides(sc, seed, d, p)
            + [f"aggregation.scheme={scheme}", f"privacy.enabled={private}", "privacy.epsilon=1", *overrides]
            for d, p in settings for scheme in ("projavg", "rlavg") for private in (True, False) for seed in range(sc.seeds)
        }
        summaries = run_grid(jobs, out / "runs", workers)
        rows = []
        for panel, d, p, d_m, ambient, k, predicted, paper_proj, paper_rl in paper.TABLE9:
            ours = {}
            for scheme, label in (("projavg", "ProjAvg"), ("rlavg", "RLAvg")):
                paired = [1e4 * (private - plain) for private, plain in zip(
                    _seed_gaps(summaries, (d, p, scheme, True), sc.seeds), _seed_gaps(summaries, (d, p, scheme, False), sc.seeds))]
                ours[label] = fmt_median(paired)
            sigma = summaries[(d, p, "projavg", True, 0)]["sigma"]
            ours["eta sigma^2 d_M / k (1e-4)"] = 1e4 * 0.2 * sigma ** 2 * p * (d - p) / sc.k
            ours["eta sigma^2 d_M / (4k) (1e-4)"] = ours["eta sigma^2 d_M / k (1e-4)"] / 4
            rows.append(Row(
                label={"panel": panel, "d": d, "p": p, "d_M": p * (d - p), "D": d * (d + 1) // 2},
                ours=ours,
                paper={"ProjAvg": paper_proj, "RLAvg": paper_rl, "eta sigma^2 d_M / k (1e-4)": predicted},
            ))
        figures = [_figure_dimension(out / "figure2ab.png", rows)]
        table = Table("Table 9: median cost of privacy at epsilon = 1 [IQR], units of 1e-4", rows,
                      note="cost = median over seeds of gap(private) - gap(non-private) at the same seed. "
                           "eta sigma^2 d_M / (4k) is the stationary excess loss of SGD whose update carries noise "
                           "of variance eta^2 tau sigma^2 / k per intrinsic coordinate per round (Hessian H: "
                           "E[F - F*] = tr(H S) / 2 with H S + S H = eta sigma^2 / k I), when clipping does not "
                           "bind; clipping that scales the records' gradients by s on average weakens the "
                           "restoring force and multiplies it by about 1 / s.")
        return write_outputs(out, "fedpca-dimension", [table], figures, preface=_preface(scale, sc, overrides))


class FedPCAParticipation(FedPCAStudy):
    """Figure 2 (c): the effect of the cohort size k on the private optimality gap."""

    name = "fedpca-participation"
    description = "Figure 2(c): optimality gap vs clients per round k (epsilon = 1)"
    laptop_minutes = {"tiny": 1, "full": 20}

    def run(self, out: Path, scale: str, workers=None, seeds=None, overrides=()) -> Path:
        sc = replace(SCALES[scale], seeds=seeds or SCALES[scale].seeds)
        ks = sorted({max(1, sc.n // 10), max(1, sc.n // 5), max(1, sc.n // 2), sc.n})
        d, p = (40, 4) if scale == "full" else (10, 2)
        jobs = {
            (k, scheme, seed): base_overrides(sc, seed, d, p)
            + [f"federation.clients_per_round={k}", f"aggregation.scheme={scheme}", "privacy.epsilon=1", *overrides]
            for k in ks for scheme in ("projavg", "rlavg") for seed in range(sc.seeds)
        }
        summaries = run_grid(jobs, out / "runs", workers)
        rows, series = [], {"ProjAvg": [], "RLAvg": []}
        for k in ks:
            ours = {}
            for scheme, label in (("projavg", "ProjAvg"), ("rlavg", "RLAvg")):
                gaps = _seed_gaps(summaries, (k, scheme), sc.seeds)
                ours[label] = fmt_median(gaps)
                series[label].append(median_iqr(gaps))
            rows.append(Row(label={"k": k}, ours=ours))
        figures = [_figure(out / "figure2c.png", ks, series, "clients per round k", "optimality gap",
                           "Figure 2(c): effect of participation", logy=True)]
        table = Table("Figure 2(c): median optimality gap [IQR] vs k", rows,
                      note="The paper gives this panel as a figure only; no table values to compare.")
        return write_outputs(out, "fedpca-participation", [table], figures, preface=_preface(scale, sc, overrides))


class FedPCAAccounting(FedPCAStudy):
    """Figure 2 (d) and Table 10: our accounting against PriRFed's at several epsilons."""

    name = "fedpca-accounting"
    description = "Table 10 / Figure 2(d): ProjAvg, RLAvg, RetAvg (ours) vs PriRFed at epsilon 0.5..10"
    laptop_minutes = {"tiny": 2, "full": 20}

    def run(self, out: Path, scale: str, workers=None, seeds=None, overrides=()) -> Path:
        sc = replace(SCALES[scale], seeds=seeds or SCALES[scale].seeds)
        d, p = (40, 4) if scale == "full" else (10, 2)
        arms = [("projavg", "exact", None), ("rlavg", "exact", None), ("retavg", "exact", None), ("retavg", "prirfed", "paper")]
        epsilons = paper.EPSILONS if scale == "full" else (1, 10)
        jobs = {
            (eps, scheme, accountant, seed): base_overrides(sc, seed, d, p) + [
                f"aggregation.scheme={scheme}", f"privacy.accountant={accountant}", f"privacy.epsilon={eps}",
                f"optim.default.lr={paper.TABLE10[eps][5] if lr == 'paper' else 0.2}", *overrides,
            ]
            for eps in epsilons for scheme, accountant, lr in arms for seed in range(sc.seeds)
        }
        jobs.update({
            (None, "projavg", "none", seed): base_overrides(sc, seed, d, p) + [
                "aggregation.scheme=projavg", "privacy.enabled=false", *overrides]
            for seed in range(sc.seeds)
        })
        summaries = run_grid(jobs, out / "runs", workers)
        floor = _seed_gaps(summaries, (None, "projavg", "none"), sc.seeds)
        rows, series = [], {"ProjAvg": [], "RLAvg": [], "RetAvg": [], "PriRFed": []}
        for eps in epsilons:
            sigma = summaries[(eps, "projavg", "exact", 0)]["sigma"]
            ours = {
                "sigma ours": sigma,
                "sigma PriRFed": summaries[(eps, "retavg", "prirfed", 0)]["sigma"],
                "gap non-private": fmt_median(floor),
                "eta sigma^2 d_M / (4k)": 0.2 * sigma ** 2 * p * (d - p) / (4 * sc.k),
            }
            for scheme, accountant, label in (("projavg", "exact", "ProjAvg"), ("rlavg", "exact", "RLAvg"),
                                              ("retavg", "exact", "RetAvg"), ("retavg", "prirfed", "PriRFed")):
                gaps = _seed_gaps(summaries, (eps, scheme, accountant), sc.seeds)
                ours[f"gap {label}"] = fmt_median(gaps)
                series[label].append(median_iqr(gaps))
                if label == "ProjAvg":
                    ours["cost ProjAvg"] = fmt_median([g - f for g, f in zip(gaps, floor)])
            ref = paper.TABLE10[eps]
            rows.append(Row(label={"epsilon": eps}, ours=ours, paper={
                "sigma ours": ref[0], "sigma PriRFed": ref[1], "gap ProjAvg": ref[2], "gap RLAvg": ref[3],
                "gap RetAvg": ref[4], "gap PriRFed": ref[6],
            }))
        paper_gaps = {"ProjAvg": 2, "RLAvg": 3, "RetAvg": 4, "PriRFed": 6}
        figures = [_figure(out / "figure2d.png", list(epsilons), series, "target epsilon", "optimality gap",
                           "Figure 2(d): accounting", logy=True,
                           paper_series={label: [paper.TABLE10[e][i] for e in epsilons] for label, i in paper_gaps.items()}
                           if scale == "full" else None)]
        table = Table("Table 10: noise level and median optimality gap [IQR]", rows,
                      note="PriRFed = RetAvg at the noise of PriRFed's round-level accounting, with its tuned step size. "
                           "gap non-private: ProjAvg without clipping or noise (the same runs for every row); "
                           "cost ProjAvg: the seeds' paired gap(private) - gap(non-private), beside "
                           "eta sigma^2 d_M / (4k), the stationary excess loss of the DP noise (Table 9's note).")
        return write_outputs(out, "fedpca-accounting", [table], figures, preface=_preface(scale, sc, overrides))


def _preface(scale: str, sc: Scale, overrides: Sequence[str] = ()) -> str:
    text = (f"Scale `{scale}`: n={sc.n}, k={sc.k}, m={sc.m}, tau={sc.tau}, B={sc.batch}, T={sc.rounds}, "
            f"{sc.seeds} seeds, clip C={FITTED_CLIP} (fitted to Table 10's sigma column).")
    if overrides:
        text += " Every run also with: " + ", ".join(f"`{o}`" for o in overrides) + "."
    return text + "\n"
