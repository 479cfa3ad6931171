"""The audit table of the README: ``rfedray audit`` at epsilon 1, 2, 4, 8 on both gradient paths, and
two broken mechanisms.

::

    python scripts/audit_table.py [--trials 200] [--seed 11] [--epsilons 1 2 4 8] [--manifolds grassmann stiefel]

Every row is one audit of :data:`rfedray.audit.AUDIT_SETTING` (federated PCA on Gr(10, 2) through its
closed-form per-record rule, or on St(10, 2) through ``vmap(grad)``), seeded; it prints a Markdown
table (claim, 95% lower bound, the shift of the canaries' statistic against the claimed mechanism's,
trials x canaries, wall time, verdict) after a line describing the machine.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from rfedray.audit import AUDIT_SETTING, AuditPlan, audit
from rfedray.config import load_config

PATHS = {"grassmann": "Gr(10, 2), closed-form rule", "stiefel": "St(10, 2), vmap(grad)"}


def rows(trials: int, seed: int, epsilons: list[float], manifolds: list[str]):
    """``(path, mechanism, report)`` for every audit of the table."""
    for manifold in manifolds:
        for epsilon in epsilons:
            cfg = load_config(None, [*AUDIT_SETTING, f"model.options.manifold={manifold}", f"privacy.epsilon={epsilon}"])
            yield manifold, "real", audit(cfg, AuditPlan(trials=trials, seed=seed))
        cfg = load_config(None, [*AUDIT_SETTING, f"model.options.manifold={manifold}"])
        for name, broken in (("noise x0.5", dict(noise_scale=0.5)), ("clipping off", dict(clip_scale=1e4))):
            yield manifold, name, audit(cfg, AuditPlan(trials=trials, seed=seed + 1, **broken))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--manifolds", nargs="+", choices=list(PATHS), default=list(PATHS))
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print("| model, gradient path | mechanism | claimed epsilon | 95% lower bound | shift (claimed mechanism's) "
          "| trials x canaries | time | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for manifold, mechanism, r in rows(args.trials, args.seed, args.epsilons, args.manifolds):
        verdict = "**violation**" if r["violated"] else "consistent"
        print(f"| {PATHS[manifold]} | {mechanism} | {r['epsilon_claimed']:.3g} | {r['epsilon_lower']:.3g} | "
              f"{r['shift']:.3f} ({r['shift_expected']:.3f}) | {r['trials']} x {r['canaries']} | "
              f"{r['wall_seconds'] / 60:.1f} min | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
