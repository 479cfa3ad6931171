"""The ``rfedray`` command line.

::

    rfedray run [CONFIG] [key=value ...] [--engine ray|local] [--resume RUN_DIR] [--quiet]
    rfedray config show [CONFIG] [key=value ...]
    rfedray config init [DIR]
    rfedray privacy calibrate|epsilon|table ...
    rfedray --version

Every user error (bad config value, missing file, unusable directory) is printed as one line
``error: ...`` on stderr with exit status 2, never as a traceback; a run that fails once started
(:class:`~rfedray.errors.RunFailure`) exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from rfedray import __version__
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


def cmd_run(args: argparse.Namespace) -> int:
    from rfedray.config import load_items, split_items
    from rfedray.federated.rundir import RunDirectory, new_run_id
    from rfedray.runner import resume_config, run_discarding_refused

    extra = [f"run.engine={args.engine}"] if args.engine else []
    if args.resume:
        path, overrides = split_items(args.items)
        if path is not None:
            raise RfedrayError("--resume: give key=value overrides only; the config is the run directory's config.yaml")
        run_dir = RunDirectory(args.resume)
        cfg = resume_config(run_dir, [*overrides, *extra])
    else:
        cfg = load_items(args.items, extra)
        run_dir = RunDirectory.create(cfg.run.output_dir, new_run_id(cfg.run.name))
    print(run_dir.path, flush=True)
    args.run_dir = run_dir.path
    summary = run_discarding_refused(cfg, run_dir, quiet=args.quiet, resume=bool(args.resume))
    if summary.get("halted"):
        print(f"halted: {summary['halt_reason']}", file=sys.stderr)
    return 0


def cmd_config_init(args: argparse.Namespace) -> int:
    from rfedray.paths import packaged_configs

    folder = Path(args.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RfedrayError(f"config init {folder}: cannot create the folder ({exc.strerror})") from None
    for name, source in packaged_configs().items():
        target = folder / name
        if target.exists():
            print(f"kept     {target} (exists)")
            continue
        target.write_bytes(source.read_bytes())
        print(f"written  {target}")
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
    parser.add_argument("--version", action="version", version=f"rfedray {__version__}")
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
    init = config_sub.add_parser("init", help="copy the packaged configurations into a folder, to edit them",
                                 description="Copy the configurations shipped with rfedray into DIR (existing files are kept).")
    init.add_argument("dir", nargs="?", default="configs", metavar="DIR", help="where to put them (default: ./configs)")
    init.set_defaults(func=cmd_config_init)

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
