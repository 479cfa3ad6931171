"""Federated PCA from Python: the default job (synthetic clients sharing a subspace of R^40, learnt on
the Grassmann manifold Gr(40, 4) at epsilon = 1), as ``rfedray run fedpca`` runs it.

    python examples/federated_pca.py                  # the local engine, 50 rounds
    python examples/federated_pca.py --engine ray     # client actors on a local Ray instance
"""

from __future__ import annotations

import argparse

import rfedray


def main(argv: list[str] | None = None) -> rfedray.RunResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("local", "ray"), default="local")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args(argv)

    result = rfedray.run("fedpca", f"run.rounds={args.rounds}", engine=args.engine)
    print(result.run_dir)                               # runs/fedpca-<date>-<id>/
    print(result.summary["epsilon_spent"])              # at most 1.0, the configured target
    print([r["metric_oracle_gap"] for r in result.metrics])    # the optimality gap, round by round
    projector = result.final_params["subspace"]         # the learnt point of Gr(40, 4), a 40 x 40 projector
    print(float(projector.trace()))                     # its rank, 4
    return result


if __name__ == "__main__":
    main()
