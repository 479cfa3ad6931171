"""Table 15: aggregation time per round of the four schemes on SPDNet-shaped models.

Each model is a BiMap weight on St(d, p) and a Euclidean linear head on the vectorised ``p x p``
LogEig output (``p(p+1)/2`` features). One round is what a scheme adds to plain averaging: the k
client submissions plus the server's combine. Schemes are timed interleaved within every repeat,
so the ratios come from the same run under the same load.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rfedray.aggregation import SCHEMES, combine, submit
from rfedray.geometry import Euclidean, ProductManifold, Stiefel
from rfedray.studies import paper
from rfedray.studies.base import MedianIQR, Row, Table, median_iqr, write_outputs

# dataset, channels d, BiMap output p, classes, clients
MODELS = [
    ("BNCI2014_001", 22, 16, 4, 3),
    ("Weibo2014", 60, 20, 7, 5),
    ("Cho2017", 64, 16, 2, 26),
]
REPEATS = {"tiny": 5, "full": 100}


def spdnet_product(d: int, p: int, classes: int) -> ProductManifold:
    return ProductManifold({"bimap": Stiefel(d, p), "head": Euclidean(p * (p + 1) // 2, classes)})


def local_iterates(prod: ProductManifold, theta: dict, k: int, g: torch.Generator, drift: float) -> list[dict]:
    """k client iterates a local-training distance ``drift`` away from ``theta``."""
    out = []
    for _ in range(k):
        z = {name: torch.randn(m.shape, generator=g, dtype=theta[name].dtype) for name, m in prod.groups.items()}
        v = prod.proj_tangent(theta, z)
        scale = drift / float(prod.norm(v))
        out.append(prod.retract(theta, {name: scale * t for name, t in v.items()}))
    return out


def round_seconds(scheme, prod: ProductManifold, theta: dict, local: list[dict]) -> float:
    start = time.perf_counter()
    combine(scheme, prod, theta, [submit(scheme, prod, theta, y) for y in local])
    return time.perf_counter() - start


def bench_model(d: int, p: int, classes: int, k: int, repeats: int, g: torch.Generator, dtype: torch.dtype) -> dict:
    """Median and quartiles (ms) of each scheme's round time, timed interleaved."""
    prod = spdnet_product(d, p, classes)
    theta = prod.random_point(generator=g, dtype=dtype)
    local = local_iterates(prod, theta, k, g, drift=0.05)
    times: dict[str, list[float]] = {name: [] for name in SCHEMES}
    for scheme in SCHEMES.values():
        round_seconds(scheme, prod, theta, local)
    for _ in range(repeats):
        for name, scheme in SCHEMES.items():
            times[name].append(round_seconds(scheme, prod, theta, local))
    return {name: MedianIQR(median_iqr([1e3 * t for t in ts])) for name, ts in times.items()}


class AggregationCost:
    """Table 15: aggregation time per round by scheme, with the ratio to ProjAvg."""

    name = "aggregation-cost"
    description = "Table 15: aggregation time per round (ms) by scheme and the RetAvg/ProjAvg ratio"
    laptop_minutes = {"tiny": 0.2, "full": 2}

    def run(self, out: Path, scale: str, workers=None) -> Path:
        g = torch.Generator().manual_seed(0)
        rows = []
        for dataset, d, p, classes, k in MODELS:
            res = bench_model(d, p, classes, k, REPEATS[scale], g, torch.float64)
            ref = paper.TABLE15[dataset]
            ours = {"ProjAvg": res["projavg"], "RLAvg": res["rlavg"], "RetAvg": res["retavg"], "KFAvg": res["kfavg"],
                    "RetAvg/ProjAvg": res["retavg"][0] / res["projavg"][0]}
            rows.append(Row(label={"dataset": f"{dataset} ({k})", "model": f"St({d},{p}) + R^{p * (p + 1) // 2}x{classes}"},
                            ours=ours, paper={"ProjAvg": ref["projavg"], "RLAvg": ref["rlavg"], "RetAvg": ref["retavg"],
                                              "RetAvg/ProjAvg": ref["ratio"]}))
        table = Table("Table 15: aggregation time per round (ms), median [IQR]", rows,
                      note="Ours: float64, the aggregation alone on synthetic client iterates (no training). "
                           "The paper's times are medians over the rounds of its non-private runs, on its hardware: "
                           "compare the ratios, not the absolute times.")
        return write_outputs(out, "aggregation-cost", [table])
