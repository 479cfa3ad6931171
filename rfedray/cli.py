"""The ``rfedray`` command line.

::

    rfedray run [CONFIG] [key=value ...] [--engine ray|local] [--resume RUN_DIR] [--quiet]
    rfedray config show [CONFIG] [key=value ...]
    rfedray privacy calibrate|epsilon|table ...

Every user error (bad config value, missing file, unusable directory) is printed as one line
``error: ...`` on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from typing import Optional, Sequence

from rfedray.errors import RfedrayError

SUBCOMMAND_MODULES = (
    "rfedray.privacy.commands",
    "rfedray.studies.commands",
    "rfedray.report",
    "rfedray.mestimation.commands",
    "rfedray.audit",
)


def cmd_config_show(args: argparse.Namespace) -> int:
    from rfedray.config import load_items, to_yaml

    print(to_yaml(load_items(args.items)), end="")
    return 0


def _resume_config(args: argparse.Namespace, run_dir):
    from rfedray.config import load_config_text, split_items

    if not run_dir.is_file("config.yaml"):
        raise RfedrayError(f"--resume {run_dir.path}: not a run directory (no config.yaml there)")
    path, overrides = split_items(args.items)
    if path is not None:
        raise RfedrayError("--resume: give key=value overrides only; the config is the run directory's config.yaml")
    return load_config_text(run_dir.read_bytes("config.yaml"), str(run_dir.config), overrides)


def cmd_run(args: argparse.Namespace) -> int:
    from rfedray.config import load_items
    from rfedray.federated.rundir import RunDirectory, RunDirectoryWriteError, new_run_id
    from rfedray.runner import run

    extra = [f"run.engine={args.engine}"] if args.engine else []
    if args.resume:
        run_dir = RunDirectory(args.resume)
        cfg = _resume_config(args, run_dir)
        if args.engine:
            cfg.run.engine = args.engine
    else:
        cfg = load_items(args.items, extra)
        run_dir = RunDirectory.create(cfg.run.output_dir, new_run_id(cfg.run.name))
    print(run_dir.path, flush=True)
    args.run_dir = run_dir.path
    try:
        summary = run(cfg, run_dir, quiet=args.quiet, resume=bool(args.resume))
    except RfedrayError as exc:
        if not args.resume and not run_dir.exists("checkpoint.pt"):
            # Refused before the run's first checkpoint (nothing charged): leave no empty run directory behind.
            run_dir.remove_all()
            if hasattr(exc, "problem"):
                raise RunDirectoryWriteError(f"{exc.problem}; nothing was charged and the run directory is removed: "
                                             f"{exc.remedy} and run the command again") from None
        raise
    if summary.get("halted"):
        print(f"halted: {summary['halt_reason']}", file=sys.stderr)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the run stops where it is, Ray is shut down, exit status 143."""


class SigtermHandler:
    """Raises :class:`Terminated` on SIGTERM and remembers it: inside a Ray call the exception
    reaches the caller as a plain ``KeyboardInterrupt`` (Ray turns an interrupted wait into one)."""

    received = False

    def __call__(self, signum, frame) -> None:
        self.received = True
        raise Terminated()


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record, never to a stale stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure_logging(level: int) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):  # as basicConfig(force=True): one handler, ours
        root.removeHandler(handler)
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rfedray",
        description="Record-level differentially private federated learning on Riemannian manifolds, on Ray.",
    )
    parser.add_argument("--verbose", action="store_true", help="log debug information")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug information")
    run = sub.add_parser("run", help="run a federation and write a run directory", parents=[verbose],
                         description="Run a federation. Prints the run directory, writes summary.json there.")
    run.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                     help="a YAML config (default: the built-in federated-PCA config) and dotlist overrides")
    run.add_argument("--engine", choices=("ray", "local"), help="override run.engine")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    run.add_argument("--quiet", action="store_true", help="one plain line per round instead of a live progress line")
    run.set_defaults(func=cmd_run)

    config = sub.add_parser("config", help="inspect configurations")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved configuration",
                                 description="Print the configuration after defaults, file and overrides.")
    show.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]")
    show.set_defaults(func=cmd_config_show)

    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come after options (e.g. `run cfg.yaml --quiet run.seed=1`).
    stray = [item for item in extra if "=" not in item or item.startswith("-")]
    if stray or (extra and not hasattr(args, "items")):
        parser.error("unrecognized arguments: " + " ".join(stray or extra))
    if extra:
        args.items = [*args.items, *extra]
    _configure_logging(logging.DEBUG if args.verbose else logging.WARNING)
    sigterm = SigtermHandler()
    previous = signal.signal(signal.SIGTERM, sigterm)
    try:
        return int(args.func(args) or 0)
    except RfedrayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated) or sigterm.received
        what, code = ("terminated (SIGTERM)", 128 + signal.SIGTERM) if terminated else ("interrupted", 130)
        run_dir = getattr(args, "run_dir", None)
        if run_dir is None:
            print(what, file=sys.stderr)
        else:
            print(f"{what}: the run directory keeps the last checkpoint and every charge; continue with "
                  f"rfedray run --resume {run_dir}", file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
