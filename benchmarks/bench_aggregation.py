"""Aggregation time per round of the four schemes on SPDNet-shaped models (the paper's Table 15).

Each model is a BiMap weight on St(d, p) and a Euclidean linear head on the vectorised
``p x p`` LogEig output (``p(p+1)/2`` features). One round is what a scheme adds to plain averaging:
the k client submissions plus the server's combine. Schemes are timed interleaved within every
repeat, so the ratios come from the same run under the same load.

Run: ``python benchmarks/bench_aggregation.py [--repeats 30] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from rfedray.aggregation import SCHEMES
from rfedray.studies import paper
from rfedray.studies.aggregation_cost import MODELS, bench_model, local_iterates, round_seconds, spdnet_product

PAPER_RATIO = {name: v["ratio"] for name, v in paper.TABLE15.items()}
LINEARITY_CLIENTS = (13, 26, 52, 104)


def projavg_scaling(repeats: int, g: torch.Generator, dtype: torch.dtype) -> list[tuple[int, float]]:
    """Median ProjAvg round time (ms) on the Cho2017 shapes for growing cohorts."""
    prod = spdnet_product(64, 16, 2)
    theta = prod.random_point(generator=g, dtype=dtype)
    pool = local_iterates(prod, theta, max(LINEARITY_CLIENTS), g, drift=0.05)
    rows = []
    for k in LINEARITY_CLIENTS:
        round_seconds(SCHEMES["projavg"], prod, theta, pool[:k])
        times = [round_seconds(SCHEMES["projavg"], prod, theta, pool[:k]) for _ in range(repeats)]
        rows.append((k, 1e3 * statistics.median(times)))
    return rows


def affine_fit(rows: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares ``t = a + b k`` and its coefficient of determination R^2."""
    ks, ts = [float(k) for k, _ in rows], [t for _, t in rows]
    mk, mt = statistics.fmean(ks), statistics.fmean(ts)
    b = sum((k - mk) * (t - mt) for k, t in zip(ks, ts)) / sum((k - mk) ** 2 for k in ks)
    a = mt - b * mk
    ss_res = sum((t - a - b * k) ** 2 for k, t in zip(ks, ts))
    ss_tot = sum((t - mt) ** 2 for t in ts)
    return a, b, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per scheme and model (default 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.repeats < 4:
        parser.error("--repeats must be >= 4 (quartiles are reported)")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)

    print(f"Aggregation time per round (ms): median [IQR] over {args.repeats} rounds; "
          f"{args.dtype}, {args.threads} thread(s), torch {torch.__version__}")
    header = f"{'dataset (clients)':<19} {'model':<22} "
    header += " ".join(f"{n:>22}" for n in ("ProjAvg", "RLAvg", "RetAvg", "KFAvg"))
    header += f" {'RetAvg/ProjAvg':>15} {'RLAvg/ProjAvg':>14} {'paper Ret/Proj':>15}"
    print(header)
    print("-" * len(header))
    cheapest = True
    for dataset, d, p, classes, k in MODELS:
        res = bench_model(d, p, classes, k, args.repeats, g, dtype)
        cells = " ".join(f"{q2:>8.3f} [{q1:.3f},{q3:.3f}]".rjust(22) for q2, q1, q3 in res.values())
        proj = res["projavg"][0]
        cheapest &= all(res[n][0] > proj for n in ("rlavg", "retavg", "kfavg"))
        model = f"St({d},{p}) + R^{p * (p + 1) // 2}x{classes}"
        print(f"{f'{dataset} ({k})':<19} {model:<22} {cells} "
              f"{res['retavg'][0] / proj:>14.1f}x {res['rlavg'][0] / proj:>13.1f}x {PAPER_RATIO[dataset]:>14d}x")

    rows = projavg_scaling(args.repeats, g, dtype)
    a, b, r2 = affine_fit(rows)
    doubling = [t2 / t1 for (_, t1), (_, t2) in zip(rows, rows[1:])]
    linear = r2 > 0.95 and b > 0 and max(doubling) < 2.2
    print()
    print("ProjAvg on St(64,16) + R^136x2 vs clients: " + ", ".join(f"k={k}: {t:.3f} ms" for k, t in rows))
    print(f"  fit t = {a:.3f} + {b * 1e3:.2f}e-3 k ms (R^2 = {r2:.3f}); time ratio per doubling of k: "
          + ", ".join(f"{x:.2f}" for x in doubling))
    print(f"CHECK ProjAvg cheapest scheme in every model: {'yes' if cheapest else 'NO'}")
    print("CHECK ProjAvg cost linear in clients (affine fit R^2 > 0.95, no doubling above 2.2x): "
          + ("yes" if linear else "NO"))


if __name__ == "__main__":
    main()
