"""Studies that need no training: noise calibration (Figure 4(b)) and aggregation cost (Table 15)."""

from __future__ import annotations

from pathlib import Path

from rfedray.privacy.accountants import ACCOUNTANTS, calibrate_sigma
from rfedray.privacy.paper import PAPER_CLIP as FITTED_CLIP
from rfedray.studies import paper
from rfedray.studies.base import Row, Table, pyplot, save_figure, write_outputs

EPSILON_GRID = {"tiny": (1, 5, 10), "full": (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20)}


class NoiseRatio:
    """Figure 4 (b): sigma_PriRFed / sigma_ours against the target epsilon (Table 4 mechanism)."""

    name = "noise-ratio"
    description = "Figure 4(b): ratio of PriRFed's noise to ours vs target epsilon"
    laptop_minutes = {"tiny": 0.2, "full": 1}

    def run(self, out: Path, scale: str, workers=None) -> Path:
        t = paper.TABLE4
        plan = dict(delta=t["delta"], rounds=t["T"], local_steps=t["tau"], batch_size=t["B"], records=t["m"], clip=FITTED_CLIP)
        rows, xs, ratios = [], [], []
        for eps in EPSILON_GRID[scale]:
            ours = calibrate_sigma(ACCOUNTANTS["exact"](), epsilon=eps, **plan)
            prirfed = calibrate_sigma(ACCOUNTANTS["prirfed"](), epsilon=eps, **plan)
            ref = paper.TABLE10.get(eps)
            rows.append(Row(
                label={"epsilon": eps},
                ours={"sigma ours": ours, "sigma PriRFed": prirfed, "ratio": prirfed / ours},
                paper={} if ref is None else {"sigma ours": ref[0], "sigma PriRFed": ref[1], "ratio": ref[1] / ref[0]},
            ))
            xs.append(eps)
            ratios.append(prirfed / ours)
        figure = _ratio_figure(out, xs, ratios)
        table = Table("Figure 4(b): noise levels and their ratio (paper: 5 to 6 times)", rows,
                      note="Mechanism of Table 4 (m=5000, B=500, tau=10, T=200, delta=1e-5); the paper's values are Table 10's.")
        return write_outputs(out, "noise-ratio", [table], [figure])


def _ratio_figure(out: Path, xs, ratios) -> str:
    plt = pyplot()

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ax.plot(xs, ratios, marker="o")
    ax.axhspan(5, 6, color="0.9", label="paper: 5-6x")
    ax.set_xscale("log")
    ax.set_xlabel("target epsilon")
    ax.set_ylabel("sigma PriRFed / sigma ours")
    ax.set_title("Figure 4(b)", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, out / "figure4b.png")
