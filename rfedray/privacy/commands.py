"""The ``privacy`` command: calibrate sigma, read epsilon, reproduce the paper's Table 10.

::

    rfedray privacy calibrate --epsilon E --delta D --rounds T --local-steps TAU --batch-size B \\
                              --records M --clip C [--accountant exact|prirfed] [--json]
    rfedray privacy epsilon   --sigma S --delta D --rounds T --local-steps TAU --batch-size B \\
                              --records M --clip C [--accountant exact|clt|prirfed] [--json]
    rfedray privacy table [--json]

Calibration certifies a budget, so it takes only accountants that bound epsilon from above;
``epsilon`` also reads the central-limit approximation ``clt``, and labels it so.

:func:`register` adds the command to the top-level parser. A bad value is reported as one line
``error: --epsilon=-1: must be > 0`` (an :class:`~rfedray.errors.RfedrayError`, exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Sequence

from rfedray.errors import RfedrayError
from rfedray.privacy import paper
from rfedray.privacy.accountants import ACCOUNTANTS, GaussianStep, calibrate_sigma
from rfedray.privacy.checks import PrivacyParameterError

_NUMBERS = {"epsilon": float, "sigma": float, "delta": float, "clip": float,
            "rounds": int, "local_steps": int, "batch_size": int, "records": int}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _values(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The named options converted to numbers, or one-line errors naming the flag."""
    values = {}
    for name in names:
        raw = getattr(args, name)
        kind = _NUMBERS[name]
        try:
            values[name] = kind(raw)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise RfedrayError(f"{_flag(name)}={raw}: must be {noun}") from None
    return values


def _accountant(args: argparse.Namespace):
    if args.accountant not in ACCOUNTANTS:
        raise RfedrayError(f"--accountant={args.accountant}: must be one of {', '.join(ACCOUNTANTS)}")
    return ACCOUNTANTS[args.accountant]()


def _run(args: argparse.Namespace, compute) -> Any:
    """Call ``compute()``; a parameter error becomes ``--flag=raw: allowed`` with the text the user typed."""
    try:
        return compute()
    except PrivacyParameterError as exc:
        raw = getattr(args, exc.name, exc.value)
        where = _flag(exc.name) if hasattr(args, exc.name) else exc.name
        raise RfedrayError(f"{where}={raw}: {exc.allowed}") from None


_MECHANISM = ("delta", "rounds", "local_steps", "batch_size", "records", "clip")


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``privacy calibrate``: print the smallest sigma meeting ``(epsilon, delta)``."""
    accountant = _accountant(args)
    values = _values(args, ("epsilon",) + _MECHANISM)
    sigma = _run(args, lambda: calibrate_sigma(accountant, **values))
    if args.json:
        print(json.dumps({"sigma": sigma, "epsilon": values["epsilon"], "delta": values["delta"],
                          "accountant": args.accountant}))
    else:
        print(f"{sigma:.6g}")
    return 0


def cmd_epsilon(args: argparse.Namespace) -> int:
    """``privacy epsilon``: print the epsilon of one client after ``rounds`` participations."""
    accountant = _accountant(args)
    values = _values(args, ("sigma",) + _MECHANISM)

    def epsilon_of() -> float:
        step = GaussianStep.clipped_mean(sigma=values["sigma"], clip=values["clip"], batch_size=values["batch_size"],
                                         records=values["records"])
        return accountant.epsilon(step, rounds=values["rounds"], local_steps=values["local_steps"], delta=values["delta"])

    epsilon = _run(args, epsilon_of)
    if args.json:
        print(json.dumps({"epsilon": epsilon, "sigma": values["sigma"], "delta": values["delta"],
                          "accountant": args.accountant, "upper_bound": accountant.upper_bound}))
    elif accountant.upper_bound:
        print(f"{epsilon:.6g}")
    else:
        print(f"{epsilon:.6g} (approximation: {args.accountant} does not bound epsilon from above)")
    return 0


def format_table(rows: Sequence[paper.Table10Row], clip: float) -> str:
    """Table 10 as text: both accountings beside the paper's values, and their ratio."""
    s = paper.SETTING
    worst = max(max(abs(r.diff_ours), abs(r.diff_prirfed)) for r in rows)
    lines = [
        f"Table 10: n={s.n_clients}, k={s.clients_per_round}, m={s.records}, tau={s.local_steps}, "
        f"B={s.batch_size}, T={s.rounds}, delta={s.delta:g}",
        f"clip C={clip:g} (fitted to the table: the paper does not print it)",
        "",
        f"{'epsilon':>7}  {'ours':>9} {'paper':>8} {'diff':>8}  "
        f"{'PriRFed':>9} {'paper':>8} {'diff':>8}  {'PriRFed/ours':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.epsilon:>7g}  {r.sigma_ours:>9.5f} {r.paper_ours:>8g} {100 * r.diff_ours:>+7.2f}%  "
            f"{r.sigma_prirfed:>9.5f} {r.paper_prirfed:>8g} {100 * r.diff_prirfed:>+7.2f}%  {r.ratio:>12.2f}"
        )
    verdict = "within" if worst <= paper.TOLERANCE else "NOT within"
    lines += ["", f"largest |diff| {100 * worst:.2f}%: {verdict} {100 * paper.TOLERANCE:g}% of the paper"]
    return "\n".join(lines)


def cmd_table(args: argparse.Namespace) -> int:
    """``privacy table``: reproduce Table 10; exit status 1 if an entry is off by more than 1%."""
    rows = paper.reproduce(paper.PAPER_CLIP)
    worst = max(max(abs(r.diff_ours), abs(r.diff_prirfed)) for r in rows)
    if args.json:
        print(json.dumps({
            "clip": paper.PAPER_CLIP,
            "setting": dataclasses.asdict(paper.SETTING),
            "rows": [
                {"epsilon": r.epsilon, "sigma_ours": r.sigma_ours, "paper_ours": r.paper_ours,
                 "diff_ours": r.diff_ours, "sigma_prirfed": r.sigma_prirfed, "paper_prirfed": r.paper_prirfed,
                 "diff_prirfed": r.diff_prirfed, "ratio": r.ratio}
                for r in rows
            ],
            "max_abs_diff": worst,
        }))
    else:
        print(format_table(rows, paper.PAPER_CLIP))
    return 0 if worst <= paper.TOLERANCE else 1


def _mechanism_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delta", required=True, metavar="D", help="delta, in (0, 1)")
    parser.add_argument("--rounds", required=True, metavar="T", help="participations of the client, >= 1")
    parser.add_argument("--local-steps", dest="local_steps", required=True, metavar="TAU",
                        help="local steps per round, >= 1")
    parser.add_argument("--batch-size", dest="batch_size", required=True, metavar="B",
                        help="records per step, in [1, M]")
    parser.add_argument("--records", required=True, metavar="M", help="records of the (smallest) client")
    parser.add_argument("--clip", required=True, metavar="C", help="clipping norm, > 0")
    parser.add_argument("--accountant", default="exact", metavar="NAME",
                        help=f"one of {', '.join(ACCOUNTANTS)} (default: exact; clt is an approximation: "
                             "epsilon read-outs only, never calibration)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``privacy`` command (``calibrate``, ``epsilon``, ``table``) to a CLI's subparsers."""
    privacy = subparsers.add_parser(
        "privacy", help="calibrate sigma, read epsilon, reproduce Table 10",
        description="Record-level privacy accounting of DP-RFedProj (one client's transcript).",
    )
    actions = privacy.add_subparsers(dest="privacy_command", metavar="ACTION", required=True)

    for name, func, summary, description, given, metavar, given_help in (
        ("calibrate", cmd_calibrate, "smallest sigma meeting (epsilon, delta)",
         "Print the smallest absolute noise std sigma with which the accountant certifies (epsilon, delta).",
         "--epsilon", "E", "target epsilon, > 0"),
        ("epsilon", cmd_epsilon, "epsilon of a client after T rounds at a given sigma",
         "Print the epsilon one client has spent after T participations of TAU steps at noise sigma.",
         "--sigma", "S", "absolute noise std, > 0"),
    ):
        action = actions.add_parser(name, help=summary, description=description)
        action.add_argument(given, required=True, metavar=metavar, help=given_help)
        _mechanism_options(action)
        action.set_defaults(func=func)

    table = actions.add_parser(
        "table", help="reproduce the paper's Table 10",
        description="Calibrate sigma for Table 10 with our accounting and PriRFed's, beside the paper's values.",
    )
    table.add_argument("--json", action="store_true", help="print one JSON object")
    table.set_defaults(func=cmd_table)

