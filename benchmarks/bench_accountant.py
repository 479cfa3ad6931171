"""Timings of the exact accountant on the paper's Table 10 setting (m=5000, B=500, tau=10, T=200).

For every epsilon of Table 10:

* ``calibrate``: one :func:`~rfedray.privacy.accountants.calibrate_sigma` with a fresh accountant;
* ``epsilon``: one epsilon of a fresh accountant at 2,000 steps (one-step PLD, FFT, reading);
* ``check``: one :meth:`~rfedray.privacy.ledger.PrivacyLedger.authorize` taking the worst client
  from 199 to 200 participations (2,000 steps) in a ledger that already charged 199 rounds.

Times are CPU seconds of this process (``time.process_time``), the median of ``--repeat`` runs.

Usage::

    python benchmarks/bench_accountant.py [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rfedray.privacy import paper
from rfedray.privacy.accountants import ExactAccountant, calibrate_sigma
from rfedray.privacy.ledger import PrivacyLedger
from rfedray.privacy.plan import GaussianMechanism


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def bench(epsilon: float, clip: float, repeat: int) -> dict:
    s = paper.SETTING
    budget = dict(delta=s.delta, rounds=s.rounds, local_steps=s.local_steps, batch_size=s.batch_size,
                  records=s.records, clip=clip)
    sigma = calibrate_sigma(ExactAccountant(), epsilon=epsilon, **budget)
    calibrate = [_cpu(lambda: calibrate_sigma(ExactAccountant(), epsilon=epsilon, **budget)) for _ in range(repeat)]
    mechanism = GaussianMechanism(sigma, clip, s.batch_size)
    step = mechanism.step(s.records)
    fresh = [_cpu(lambda: ExactAccountant().epsilon(step, rounds=s.rounds, local_steps=s.local_steps, delta=s.delta))
             for _ in range(repeat)]
    checks = []
    for _ in range(repeat):
        ledger = PrivacyLedger(ExactAccountant(), mechanism, local_steps=s.local_steps, delta=s.delta,
                               epsilon_target=epsilon, client_sizes=[s.records] * s.n_clients)
        state = ledger.state_dict()
        state["participations"] = [s.rounds - 1] + [s.rounds // 2] * (s.n_clients - 1)
        ledger.load_state_dict(state)
        cohort = list(range(s.clients_per_round))
        checks.append(_cpu(lambda: ledger.authorize(cohort)))
    return {
        "epsilon": epsilon,
        "sigma": sigma,
        "calibrate_s": statistics.median(calibrate),
        "epsilon_s": statistics.median(fresh),
        "check_s": statistics.median(checks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing (median reported)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = [bench(eps, paper.PAPER_CLIP, args.repeat) for eps in paper.EPSILONS]
    if args.json:
        print(json.dumps({"clip": paper.PAPER_CLIP, "rows": rows}))
        return
    print(f"exact accountant, Table 10 setting, C={paper.PAPER_CLIP:g}, 2,000 steps; "
          f"CPU seconds (median of {args.repeat})")
    print(f"{'epsilon':>7} {'sigma':>9} {'calibrate':>10} {'epsilon':>9} {'check':>8}")
    for r in rows:
        print(f"{r['epsilon']:>7g} {r['sigma']:>9.5f} {r['calibrate_s']:>10.3f} {r['epsilon_s']:>9.3f} "
              f"{r['check_s']:>8.3f}")


if __name__ == "__main__":
    main()
