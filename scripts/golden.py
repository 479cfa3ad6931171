"""Golden outputs: small seeded runs whose results must not change when the code is restructured.

::

    python scripts/golden.py record [NAME ...] [--engine local|ray]   # (re)write tests/golden/NAME-ENGINE.json
    python scripts/golden.py check  [NAME ...] [--engine local|ray]   # compare; exit status 1 on a difference

Each run goes through the command line (``rfedray run``, ``rfedray mestimation run``,
``rfedray ddpsa run``) at fixed seeds (``run.seed`` and ``privacy.noise_seed``) and small sizes,
and its run directory is reduced to what a refactoring must keep: the final model (a SHA-256 of
every tensor's bytes, and its values), ``summary.json`` and every line of ``metrics.jsonl``, less
wall times and the run id. Torch runs with one thread (the engines' client actors do too), so the
bits do not depend on the machine's core count.

Re-record only when a change is meant to change the numbers (a new noise generator, a fixed bug),
and say why in the commit message.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import platform
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
ENGINES = ("local", "ray")

RUNS: dict[str, list[str]] = {
    # The default job (configs/fedpca.yaml), small: Gr(40, 4), 10 clients, 5 per round, epsilon 1.
    "fedpca": [
        "run", str(ROOT / "configs" / "fedpca.yaml"), "run.rounds=4", "run.checkpoint_every=2",
        "federation.local_steps=3", "federation.batch_size=50", "data.options.records_per_client=300",
        "privacy.noise_seed=11",
    ],
    # SPDNet (BiMap on St(8, 4), ReEig, LogEig, linear head) on synthetic EEG covariances.
    "spdnet": [
        "run", "model.name=spdnet", "model.options.d=4", "data.source=synthetic_eeg", "data.options.channels=8",
        "data.options.trials_per_client=24", "federation.n_clients=4", "federation.clients_per_round=2",
        "federation.local_steps=2", "federation.batch_size=6", "run.rounds=3", "run.checkpoint_every=2",
        "privacy.epsilon=8", "privacy.clip=1.0", "privacy.noise_seed=12", "optim.default.lr=0.05",
    ],
    # FedNewton (private local Newton steps) on the synthetic logistic M-estimation task.
    "fednewton": [
        "mestimation", "run", str(ROOT / "configs" / "mestimation_synthetic.yaml"), "strategy.name=fednewton",
        "run.rounds=3", "data.options.records_per_client=400", "federation.batch_size=200", "privacy.noise_seed=13",
    ],
    # DDP-SA with the covered private-quantile clipping, secret-shared over 3 aggregators.
    "ddpsa": [
        "ddpsa", "run", str(ROOT / "configs" / "ddpsa_synthetic.yaml"), "run.rounds=5", "ddpsa.clipping=private_quantile",
        "federation.n_clients=4", "federation.clients_per_round=4", "data.options.records_per_client=200",
        "privacy.noise_seed=14",
    ],
}
"""The command-line arguments of every golden run (``--engine`` and the output directory are added)."""

VOLATILE = {"run_id"}
"""Keys whose values change from run to run (besides every key ending in ``_seconds``)."""


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in VOLATILE and not k.endswith("_seconds")
            and k != "seconds_per_round"}


def model_digest(model: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(model):
        t = model[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def machine() -> str:
    """What the bits may depend on beyond the code: the CPU (model and instruction sets, which decide
    the kernels MKL and torch dispatch to) and the torch build."""
    info = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
    flags = hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:12]
    cpu = f"{info.get('model name', platform.processor())} family {info.get('cpu family')} model {info.get('model')}"
    return f"{cpu} flags {flags} | torch {torch.__version__}"


def produce(name: str, engine: str) -> dict:
    """Run ``name`` on ``engine`` through the command line; the outputs a refactoring must keep."""
    from rfedray.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as out:
            stdout, stderr = io.StringIO(), io.StringIO()
            args = [*RUNS[name], f"run.output_dir={out}", "--engine", engine]
            if name in ("fedpca", "spdnet"):
                args += ["--quiet", "monitoring.progress=false"]
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                status = main(args)
            if status != 0:
                raise RuntimeError(f"golden run {name} on {engine} exited with {status}: {stderr.getvalue()[-2000:]}")
            run_dir = Path(stdout.getvalue().strip().splitlines()[0])
            summary = json.loads((run_dir / "summary.json").read_text())
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            model = torch.load(run_dir / "model_final.pt", weights_only=True)
    finally:
        torch.set_num_threads(threads)
    return {
        "run": name, "engine": engine, "args": RUNS[name],
        "model_sha256": model_digest(model),
        "model": {k: v.detach().double().flatten().tolist() for k, v in sorted(model.items())},
        "summary": _stable(summary),
        "metrics": [_stable(r) for r in metrics],
    }


@contextlib.contextmanager
def ray_instance(num_cpus: int = 2):
    """One local Ray instance for every Ray run of a command (the engines use it rather than start
    their own); shut down at the end if it was started here."""
    import logging

    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=200 * 1024**2,
                 log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def golden_path(name: str, engine: str) -> Path:
    return GOLDEN_DIR / f"{name}-{engine}.json"


def record(name: str, engine: str) -> Path:
    result = {**produce(name, engine), "machine": machine()}
    path = golden_path(name, engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return path


def _differences(expected, actual, where: str = "", rtol: float = 0.0) -> list[str]:
    """Where ``actual`` differs from ``expected`` (exactly, or beyond ``rtol`` for floats)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(expected.keys() | actual.keys()):
            if key not in actual or key not in expected:
                out.append(f"{where}.{key}: {'missing' if key not in actual else 'unexpected'}")
            else:
                out += _differences(expected[key], actual[key], f"{where}.{key}", rtol)
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(actual)} items, expected {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in _differences(e, a, f"{where}[{i}]", rtol)]
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool) and rtol > 0:
        close = math.isclose(expected, actual, rel_tol=rtol, abs_tol=rtol) or expected == actual
        return [] if close else [f"{where}: {actual!r}, expected {expected!r}"]
    return [] if expected == actual and type(expected) is type(actual) else [f"{where}: {actual!r}, expected {expected!r}"]


def compare(name: str, engine: str, actual: Optional[dict] = None) -> list[str]:
    """The differences between a fresh run and its golden file (empty when they match).

    The bits are compared exactly on the machine that recorded the file. On another CPU or torch
    build (where BLAS may sum in another order) the model digest is not compared and numbers must
    agree to 1e-6 relative: the differences then name the machines.
    """
    expected = json.loads(golden_path(name, engine).read_text())
    actual = actual if actual is not None else produce(name, engine)
    same_machine = expected.get("machine") == machine()
    keys = ("summary", "metrics", "model") + (("model_sha256",) if same_machine else ())
    diffs = _differences({k: expected[k] for k in keys}, {k: actual[k] for k in keys}, "", 0.0 if same_machine else 1e-6)
    if diffs and not same_machine:
        diffs.insert(0, f"(recorded on {expected.get('machine')!r}, checked on {machine()!r}: compared to 1e-6)")
    return diffs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "check"))
    parser.add_argument("names", nargs="*", help=f"runs (default: all of {', '.join(RUNS)})")
    parser.add_argument("--engine", choices=ENGINES, action="append", help="default: both")
    args = parser.parse_args(argv)
    names = args.names or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    engines = args.engine or ENGINES
    with ray_instance() if "ray" in engines else contextlib.nullcontext():
        failed = _each(args.action, names, engines)
    return 1 if failed else 0


def _each(action: str, names: list[str], engines) -> bool:
    failed = False
    for name in names:
        for engine in engines:
            if action == "record":
                print(f"recorded {record(name, engine).relative_to(ROOT)}")
                continue
            diffs = compare(name, engine)
            failed |= bool(diffs)
            print(f"{name}-{engine}: " + ("matches" if not diffs else f"{len(diffs)} differences"))
            for d in diffs[:20]:
                print(f"  {d}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
