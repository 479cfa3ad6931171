"""Chaos soak of the Ray engine: a long private run while client actors and the server keep dying.

This process starts ``rfedray run --engine ray`` on a small federated-PCA federation (2,000 rounds
by default) and, while it runs, kills a random client actor of that run every few seconds
(SIGKILL to the ``ray::ClientActor`` process). Once the run has passed a third of its rounds it
kills the server actor (``ray::ServerActor``), and once past two thirds the driver process itself
(``rfedray run``); after each it continues the run with ``rfedray run --resume RUN_DIR``.

The runs connect to a Ray head this script starts (:class:`RayHead`, ``RAY_ADDRESS``): a driver
that starts Ray itself runs the server in its own process, with no server actor to kill. Only
processes of that head are killed (its descendants, found by process id; never another Ray instance
on the machine); the head outlives each driver, so what a killed driver leaves there is Ray's to
clean up, and the run directory's writer token keeps it from writing into the next run. The head
and everything under it is killed at the end.

At the end it checks the run directory:

* the run completed: ``summary.json`` has ``rounds_completed == T`` and was not halted;
* epsilon spent never exceeded the target (every ``metrics.jsonl`` line, ``budget.json``, the
  summary);
* every round is accounted for: the round lines of ``metrics.jsonl`` are rounds ``0 .. T-1``, each
  exactly once, besides one ``resumed`` event line per resume;
* the final model is finite and on the manifold.

It prints one JSON report (kills survived, resumes, rounds, time, the checks) and exits with
status 0 when every check passed, 1 otherwise::

    python scripts/chaos_soak.py [--rounds 2000] [--kill-every 3 6] [--output-dir DIR] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
CONFIG = [
    "run.engine=ray", "federation.n_clients=8", "federation.clients_per_round=4", "federation.local_steps=1",
    "federation.batch_size=10", "data.options.d=6", "data.options.p=2", "data.options.records_per_client=40",
    "privacy.epsilon=4.0", "run.checkpoint_every=20", "run.evaluate_every=50", "ray.num_client_actors=4",
    "ray.num_cpus_per_actor=0.25", "ray.round_timeout_s=3", "monitoring.progress=false",
]
CLIENT_ACTOR, SERVER_ACTOR = "ray::ClientActor", "ray::ServerActor"


class RayHead:
    """A Ray head of this machine for one test, started with ``ray start --head --block``.

    Runs given its :attr:`address` (``RAY_ADDRESS``) are on a cluster: their server and accountant
    are separate actors, processes of this head that a chaos test can kill. Its processes are
    found as its descendants, so a test only ever kills its own head's processes.

    Parameters
    ----------
    log : Path
        Where ``ray start`` writes its output.
    env : dict, optional
        The head's environment, which every worker and actor it starts inherits (default: this
        process's), without ``RAY_ADDRESS`` and with token authentication (``RAY_AUTH_MODE``) by
        a fresh random token (``RAY_AUTH_TOKEN``).
    num_cpus : int
        The head's CPUs.

    Attributes
    ----------
    address : str
        The head's GCS address, ``127.0.0.1:PORT``.
    env : dict
        The environment for a run on this head: ``env`` with ``RAY_ADDRESS`` and the head's
        authentication.
    """

    def __init__(self, log: Path, env: dict | None = None, num_cpus: int = 2):
        env = dict(os.environ if env is None else env)
        env.pop("RAY_ADDRESS", None)
        # Token authentication, as ``ray start`` sets it up by default, with a token of this head's
        # own: nothing read from the user's ``~/.ray`` (a fresh machine has none).
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        # Ports free a moment ago, for every server of the head that listens on a fixed default
        # port otherwise (two heads on one machine would take the same).
        sockets = [socket.socket() for _ in range(5)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        port, dashboard, agent, client, metrics = (sock.getsockname()[1] for sock in sockets)
        for sock in sockets:
            sock.close()
        self.address = f"127.0.0.1:{port}"
        self.env = dict(env, RAY_ADDRESS=self.address)
        # Ray's sockets live under the temp dir, and a Unix socket's path is at most 107 bytes: a
        # short directory of its own in /tmp, not one under a test's (long) temporary path.
        self.temp_dir = tempfile.mkdtemp(prefix="rfedray-chaos-ray-", dir="/tmp")
        self.log = log
        ray = Path(sys.executable).with_name("ray")
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [str(ray), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                 "--include-dashboard=false", f"--dashboard-port={dashboard}",
                 f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
                 f"--metrics-export-port={metrics}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start --head did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

    def processes(self, title: str) -> list[psutil.Process]:
        """The live processes of this head (its descendants) whose command line names ``title``,
        by process id."""
        found = []
        try:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                try:
                    if title in " ".join(child.cmdline()):
                        found.append(child)
                except psutil.Error:
                    continue
        except psutil.NoSuchProcess:
            pass
        return sorted(found, key=lambda p: p.pid)

    def stop(self) -> None:
        """SIGKILL the head and every process under it, then remove its temp dir."""
        try:
            tree = [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        self.process.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def rfedray(log: Path, head: RayHead, *args: str) -> subprocess.Popen:
    """Start ``rfedray run ARGS --quiet`` on ``head``, its stdout in ``log.out`` and stderr in ``log.err``.

    Files, not pipes: the run prints a line per round, and a pipe nobody reads would block it.
    """
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return subprocess.Popen([sys.executable, "-m", "rfedray.cli", "run", *args, "--quiet"], cwd=ROOT, env=head.env,
                                stdout=out, stderr=err, text=True)


def rounds_done(run_dir: Path | None) -> int:
    """Round lines in ``metrics.jsonl`` (they are rewritten by a resume, so this can go down)."""
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return 0
    return sum('"event"' not in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())


class Soak:
    """One run of ``rounds`` rounds under chaos, resumed until it completes.

    Parameters
    ----------
    rounds : int
    kill_every : (float, float)
        Bounds of the uniform pause between client-actor kills, in seconds.
    output_dir : Path
    seed : int
        Seeds the victims and the pauses.
    deadline_s : float
        The soak gives up (and fails) after this long.
    """

    def __init__(self, rounds: int, kill_every: tuple[float, float], output_dir: Path, seed: int, deadline_s: float):
        self.rounds, self.kill_every, self.output_dir = rounds, kill_every, output_dir
        self.rng = random.Random(seed)
        self.deadline = time.monotonic() + deadline_s
        self.run_dir: Path | None = None
        self.kills = {"client_actor": 0, "server_actor": 0, "driver": 0}
        self.big_kills = [(rounds // 3, "server_actor"), (2 * rounds // 3, "driver")]
        self.resumes = 0
        self.exits: list[int] = []
        self.errors: list[str] = []
        self.tree: list[psutil.Process] = []
        self.head: RayHead | None = None

    def _log(self) -> Path:
        """Where the next ``rfedray`` process writes its output (``.out``, ``.err``)."""
        return self.output_dir / f"rfedray-{len(self.exits)}"

    def _start(self) -> subprocess.Popen:
        if self.run_dir is not None:
            self.resumes += 1
            return rfedray(self._log(), self.head, "--resume", str(self.run_dir), "--engine", "ray")
        log = self._log()
        driver = rfedray(log, self.head, *CONFIG, f"run.rounds={self.rounds}", f"run.output_dir={self.output_dir}")
        while driver.poll() is None and not log.with_suffix(".out").read_text().strip():
            time.sleep(0.2)
        first = log.with_suffix(".out").read_text().strip()
        self.run_dir = Path(first.splitlines()[0]) if first else None
        return driver

    def _kill(self, driver: subprocess.Popen, which: str) -> bool:
        """SIGKILL the driver, or one of the head's server or client actors; False when there is none yet."""
        if which == "driver":
            driver.send_signal(signal.SIGKILL)
            return True
        victims = self.head.processes(SERVER_ACTOR if which == "server_actor" else CLIENT_ACTOR)
        if not victims:
            return False
        self.rng.choice(victims).send_signal(signal.SIGKILL)
        self.kills[which] += 1
        return True

    def _follow(self, driver: subprocess.Popen) -> bool:
        """Kill while the driver runs; True when the run ended by itself with status 0.

        Client actors are killed once this driver has completed a round (not while it starts).
        """
        at_start = rounds_done(self.run_dir)
        next_kill = time.monotonic() + self.rng.uniform(*self.kill_every)
        while driver.poll() is None:
            if time.monotonic() > self.deadline:
                driver.kill()
                self.errors.append("the soak's deadline passed")
                break
            try:
                self.tree = [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
            done = rounds_done(self.run_dir)
            if self.big_kills and done >= self.big_kills[0][0]:
                which = self.big_kills[0][1]
                if self._kill(driver, which):
                    self.big_kills.pop(0)
                    if which == "driver":
                        self.kills["driver"] += 1
                        driver.wait()
            elif done > at_start and time.monotonic() >= next_kill:
                self._kill(driver, "client_actor")
                next_kill = time.monotonic() + self.rng.uniform(*self.kill_every)
            time.sleep(0.2)
        driver.wait()
        stderr = self._log().with_suffix(".err").read_text()
        self.exits.append(driver.returncode)
        self._reap()
        expected = driver.returncode in (0, -signal.SIGKILL) or "--resume" in stderr
        if not expected:
            self.errors.append(f"rfedray exited with status {driver.returncode}: {stderr.strip()[-500:]}")
        return driver.returncode == 0

    def _reap(self) -> None:
        """Kill what is left of the last driver's process tree (this script's own processes only)."""
        leftovers = [p for p in self.tree if p.is_running()]
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=10)
        self.tree = []

    def run(self) -> dict:
        """Run, kill and resume until the run completes (or the deadline); the report."""
        started = time.monotonic()
        self.head = RayHead(self.output_dir / "ray-head.log")
        try:
            while time.monotonic() < self.deadline and not self._follow(self._start()):
                if self.run_dir is None:
                    self.errors.append("the first rfedray run printed no run directory")
                    break
        finally:
            self._reap()
            self.head.stop()
        report = {
            "rounds": self.rounds, "kills": self.kills, "kills_total": sum(self.kills.values()),
            "resumes": self.resumes, "exit_codes": self.exits, "wall_seconds": round(time.monotonic() - started, 1),
            "run_dir": str(self.run_dir),
        }
        report["checks"] = check_run(self.run_dir, self.rounds, self.resumes) if self.run_dir else {"run_dir": False}
        report["errors"] = self.errors
        report["ok"] = all(report["checks"].values()) and not self.errors
        return report


def check_run(run_dir: Path, rounds: int, resumes: int) -> dict:
    """The end-of-soak checks (see the module docstring)."""
    import torch

    from rfedray.config import load_config
    from rfedray.federated.setup import build_dataset, build_model

    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    target = summary.get("epsilon_target")
    budget = json.loads((run_dir / "budget.json").read_text())["ledger"]["epsilon_spent"]
    spent = [r["epsilon_spent"] for r in lines if r.get("epsilon_spent") is not None]
    cfg = load_config(run_dir / "config.yaml")
    model = build_model(cfg, build_dataset(cfg).info)
    theta = torch.load(run_dir / "model_final.pt")
    on_manifold = all(
        bool(torch.isfinite(theta[g]).all()) and float(m.distance_to_manifold(theta[g].double())) < 1e-5
        for g, m in model.groups.items()
    )
    return {
        "completed": summary.get("rounds_completed") == rounds and summary.get("halted") is False,
        "epsilon_within_target": target is not None and max([*spent, budget, summary.get("epsilon_spent", 0.0)]) <= target,
        "every_round_once": [r["round"] for r in lines if "event" not in r] == list(range(rounds)),
        "one_event_per_resume": sum(r.get("event") == "resumed" for r in lines) == resumes,
        "final_model_on_manifold": on_manifold,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(3.0, 6.0), metavar=("MIN_S", "MAX_S"),
                        help="seconds between client-actor kills, drawn uniformly")
    parser.add_argument("--output-dir", default=None, help="where the run directory goes (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of victims and kill times")
    parser.add_argument("--deadline", type=float, default=3000.0, help="give up after this many seconds")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up of Soak.run
    with tempfile.TemporaryDirectory(prefix="chaos-soak-") as scratch:
        output = Path(args.output_dir or scratch)
        report = Soak(args.rounds, tuple(args.kill_every), output, args.seed, args.deadline).run()
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
