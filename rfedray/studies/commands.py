"""``rfedray experiment NAME [key=value ...]`` and ``rfedray experiment --list``."""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from rfedray.errors import RfedrayError
from rfedray.studies import STUDIES, get_study
from rfedray.studies.base import SCALES


def _parse(items: list[str]) -> dict[str, str]:
    options = {"scale": "full", "out": "", "workers": "", "seeds": "", "dataset": "", "ray": ""}
    overrides = []
    for item in items:
        key, sep, value = item.partition("=")
        if sep and "." in key:
            overrides.append(item)
            continue
        if not sep or key not in options:
            raise RfedrayError(f"experiment option {item!r}: allowed are " + ", ".join(f"{k}=..." for k in options)
                               + ", or a config override SECTION.KEY=VALUE")
        options[key] = value
    if options["scale"] not in SCALES:
        raise RfedrayError(f"scale={options['scale']!r}: must be one of " + ", ".join(SCALES))
    for key in ("workers", "seeds"):
        if options[key] and (not options[key].isdigit() or int(options[key]) < 1):
            raise RfedrayError(f"{key}={options[key]!r}: must be an integer >= 1")
    options["overrides"] = overrides
    return options


def cmd_experiment(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        print(f"{'study':24s} {'tiny':>8s} {'full':>10s}  description")
        for name in STUDIES:
            study = get_study(name)
            t = study.laptop_minutes
            print(f"{name:24s} {t['tiny']:>6g} m {t['full']:>8g} m  {study.description}")
        print("\nexpected run times on a 2-core laptop-class CPU; run one with: rfedray experiment NAME [scale=tiny|full] [out=DIR] [workers=N] [seeds=N] [dataset=NAME] [ray=local|ADDRESS]")
        return 0
    options = _parse(args.items)
    study = get_study(args.name)
    if options["dataset"]:
        if not hasattr(study, "dataset"):
            raise RfedrayError(f"dataset=: study {args.name!r} has no dataset to choose (the EEG studies do)")
        study = type(study)(options["dataset"])
    out = Path(options["out"] or f"experiments/{args.name}-{options['scale']}-{time.strftime('%Y%m%d-%H%M%S')}")
    workers = int(options["workers"]) if options["workers"] else None
    extra = {"seeds": int(options["seeds"])} if options["seeds"] else {}
    if extra and not getattr(study, "accepts_seeds", False):
        raise RfedrayError(f"seeds=: study {args.name!r} has no seeds to choose")
    if options["overrides"]:
        if not getattr(study, "accepts_overrides", False):
            raise RfedrayError(f"{options['overrides'][0]}: study {args.name!r} takes no config overrides "
                               "(the federated-PCA studies do)")
        extra["overrides"] = options["overrides"]
    with contextlib.ExitStack() as stack:
        if options["ray"]:
            from actors.tasks import connected

            stack.enter_context(connected(options["ray"]))
        report = study.run(out, options["scale"], workers=workers, **extra)
    print(report)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "experiment", help="reproduce one of the paper's results",
        description="Run a named study over seeds and write results.csv/json, PNG figures and report.md.",
    )
    parser.add_argument("name", nargs="?", help="study name (see --list)")
    parser.add_argument("items", nargs="*", metavar="key=value", help="scale=tiny|full, out=DIR (a re-run with the same DIR reuses the finished runs), workers=N, "
                        "seeds=N (fewer seeds than the paper's 10, for a quick look), dataset=NAME (EEG studies), "
                        "ray=local|ADDRESS (one Ray task per run, on a local instance or a cluster), "
                        "SECTION.KEY=VALUE (a config override applied to every run, after the study's own)")
    parser.add_argument("--list", action="store_true", help="list the studies with their expected run time")
    parser.set_defaults(func=cmd_experiment)
