"""Chaos test of the run directory (slow): kill, corrupt, fill and race a run over many seeded trials.

Each trial runs one seeded job to completion through a sequence of episodes (the first a new run,
the others ``--resume``); each episode does one thing an operator or the environment does, chosen
by the trial's seed: SIGKILL or SIGTERM the driver at a random round; on the Ray engine, kill the
server actor, a client actor or the accountant actor (their processes, by pid); put back an older
``budget.json``; delete ``budget.json``, ``checkpoint.pt`` or ``metrics.jsonl``; fill the disk (the
run directory is on a real 2 MiB tmpfs); start two resumes at once.

The releases are counted independently of the run: ``tests/chaos/sitecustomize.py`` appends
``round client`` to a file of the test's each time a client's local training returns a submission
(in the driver, or in a Ray client actor).

Invariant, checked after every episode: every client's participations in ``budget.json`` are at
least its counted releases, and the epsilon the run reports (``budget.json``'s, and
``summary.json``'s once the run ends) is at least the epsilon of the counted releases (computed
by the same accountant from the counts). Whenever a trial's run completes, its final model equals
the uninterrupted run's, bit for bit.

``RFEDRAY_CHAOS_TRIALS`` sets the number of trials (default 30); the report is printed with ``-s``.
"""

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from rfedray.config import load_config
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory

ROOT = Path(__file__).resolve().parents[1]
JOB = [
    "run.checkpoint_every=4", "federation.n_clients=6", "federation.clients_per_round=3", "federation.local_steps=2",
    "federation.batch_size=10", "data.options.d=6", "data.options.p=2", "data.options.records_per_client=40",
    "privacy.noise_seed=1", "run.seed=0", "privacy.epsilon=null", "privacy.sigma=0.5", "monitoring.progress=false",
    "ray.num_client_actors=2",
]
LOCAL_ACTIONS = ("kill_driver", "sigterm", "older_budget", "delete_budget", "delete_checkpoint", "delete_metrics",
                 "fill_disk", "concurrent", "none")
RAY_ACTIONS = ("kill_server", "kill_client", "kill_accountant", "kill_driver", "sigterm")
ACTOR = {"kill_server": "ray::ServerActor", "kill_client": "ray::ClientActor", "kill_accountant": "ray::AccountantActor"}


def environment(releases: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "chaos"), str(ROOT), env.get("PYTHONPATH", "")])
    env["RFEDRAY_CHAOS_RELEASES"] = str(releases)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def start(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rfedray.cli", *args, "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def rounds_logged(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"round_seconds"' in line)
    except OSError:
        return 0


def kill_at(process: subprocess.Popen, run_dir: Path, after: int, kill, timeout=240.0) -> None:
    """Call ``kill()`` once ``after`` more rounds are logged (unless the process ended first)."""
    target = rounds_logged(run_dir) + after
    deadline = time.monotonic() + timeout
    while process.poll() is None and rounds_logged(run_dir) < target and time.monotonic() < deadline:
        time.sleep(0.02)
    if process.poll() is None:
        kill()


def kill_actor(driver: subprocess.Popen, name: str) -> None:
    try:
        found = [p for p in psutil.Process(driver.pid).children(recursive=True) if name in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:
        return
    if found:
        random.Random(driver.pid).choice(found).kill()


class Trial:
    """One seeded job run to completion through chaos episodes, with the invariant checked after each."""

    def __init__(self, index: int, tmp: Path, disk: Path, references: dict):
        self.rng = random.Random(index)
        self.engine = "ray" if index % 5 == 4 else "local"
        self.rounds = self.rng.choice([10, 14, 18])
        self.tmp, self.disk, self.references = tmp, disk, references
        self.releases = tmp / "releases.txt"
        self.env = environment(self.releases)
        self.run_dir: Path | None = None
        self.snapshots: list[bytes] = []
        self.log: list[str] = []
        self.checks = 0

    def job(self) -> list[str]:
        return [*JOB, f"run.rounds={self.rounds}", f"run.engine={self.engine}"]

    # ----- the invariant ------------------------------------------------------------------------

    def released(self) -> list[int]:
        counts = collections.Counter(int(line.split()[1]) for line in self.releases.read_text().splitlines()
                                     if line.strip()) if self.releases.exists() else collections.Counter()
        return [counts[c] for c in range(6)]

    def epsilon_of(self, participations: list[int]) -> float:
        fed = Federation.prepare(load_config(None, self.job() + ["run.engine=local"]), RunDirectory(self.tmp))
        ledger = fed.make_ledger()
        state = ledger.state_dict()
        ledger.load_state_dict(dict(state, participations=participations, epsilon_spent=0.0))
        return ledger.epsilon_spent()

    def check(self) -> None:
        """Reported epsilon never below the epsilon of the releases that happened."""
        released = self.released()
        floor = self.epsilon_of(released)
        budget = json.loads((self.run_dir / "budget.json").read_text())["ledger"]
        assert all(p >= r for p, r in zip(budget["participations"], released)), (budget["participations"], released, self.log)
        assert budget["epsilon_spent"] >= floor - 1e-12, (budget["epsilon_spent"], floor, self.log)
        summary = self.run_dir / "summary.json"
        if summary.exists() and json.loads(summary.read_text())["rounds_completed"] == self.rounds:
            assert json.loads(summary.read_text())["epsilon_spent"] >= floor - 1e-12, self.log
        self.checks += 1

    def completed(self) -> bool:
        summary = self.run_dir / "summary.json"
        return summary.exists() and json.loads(summary.read_text())["rounds_completed"] == self.rounds

    # ----- episodes -----------------------------------------------------------------------------

    def command(self) -> list[str]:
        if self.run_dir is None:
            return ["run", *self.job(), f"run.output_dir={self.disk / 'runs'}"]
        return ["run", "--resume", str(self.run_dir), f"run.engine={self.engine}"]

    def launch(self) -> subprocess.Popen:
        process = start(self.command(), self.env)
        if self.run_dir is None:
            self.run_dir = Path(process.stdout.readline().strip())
        return process

    def refused(self, damage, restore, expect: str) -> None:
        """An operator's damage before a resume: it must be refused (exit 2), writing nothing; then repaired."""
        damage()
        done = subprocess.run([sys.executable, "-m", "rfedray.cli", *self.command(), "--quiet"], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=300)
        restore()
        assert done.returncode == 2 and expect in done.stderr and "Traceback" not in done.stderr, (done.stderr, self.log)

    def episode(self) -> None:
        actions = RAY_ACTIONS if self.engine == "ray" else LOCAL_ACTIONS
        action = self.rng.choice(actions) if self.run_dir is not None else self.rng.choice(("kill_driver", "sigterm", "fill_disk", "none"))
        self.log.append(action)
        budget = self.run_dir / "budget.json" if self.run_dir else None
        if action == "older_budget":
            current = budget.read_bytes()
            older = [s for s in self.snapshots if s != current]
            if older:
                self.refused(lambda: budget.write_bytes(self.rng.choice(older)), lambda: budget.write_bytes(current),
                             "is older than what this run released")
            action = "none"
        elif action in ("delete_budget", "delete_checkpoint"):
            path = budget if action == "delete_budget" else self.run_dir / "checkpoint.pt"
            kept = path.read_bytes()
            self.refused(path.unlink, lambda: path.write_bytes(kept), "is missing" if action == "delete_budget" else "no checkpoint.pt")
            action = "none"
        elif action == "delete_metrics":
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
            action = "none"
        filler = None
        if action == "fill_disk":
            filler = self.disk / "filler"
            with open(filler, "wb") as fh:
                fh.write(b"\0" * max(0, shutil.disk_usage(self.disk).free - self.rng.randint(60_000, 400_000)))
        if action == "concurrent" and self.run_dir is not None:
            first, second = self.launch(), self.launch()
            codes = [first.wait(timeout=600), second.wait(timeout=600)]
            assert set(codes) <= {0, 2} and (codes.count(0) <= 1 or self.completed()), (codes, self.log)
        else:
            process = self.launch()
            after = self.rng.randint(1, 4)
            if action in ("kill_driver", "sigterm"):
                sig = signal.SIGKILL if action == "kill_driver" else signal.SIGTERM
                kill_at(process, self.run_dir, after, lambda: os.kill(process.pid, sig))
            elif action in ACTOR:
                kill_at(process, self.run_dir, after, lambda: kill_actor(process, ACTOR[action]))
            _, err = process.communicate(timeout=600)
            if action == "kill_driver":
                os.killpg(process.pid, signal.SIGKILL) if _group_alive(process.pid) else None
            assert "Traceback" not in err, (err, self.log)
            assert process.returncode in (0, 1, 2, 143, -9), (process.returncode, err, self.log)
        if filler is not None:
            filler.unlink()
        budget = self.run_dir / "budget.json"
        if budget.is_file():
            self.snapshots.append(budget.read_bytes())
            self.check()

    def run(self, max_episodes: int = 10) -> dict:
        for _ in range(max_episodes):
            self.episode()
            if not (self.run_dir / "checkpoint.pt").exists():
                self.log.append("restart")  # refused before its first checkpoint (no room): start again
                self.run_dir = None
                continue
            if self.completed():
                break
        while not self.completed():  # chaos over: finish the run
            self.log.append("finish")
            done = subprocess.run([sys.executable, "-m", "rfedray.cli", *self.command(), "--quiet"], cwd=ROOT,
                                  env=self.env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (done.stderr, self.log)
        self.check()
        reference = self.references[self.rounds]
        final = torch.load(self.run_dir / "model_final.pt", weights_only=True)
        assert all(torch.equal(final[k], reference[k]) for k in reference), self.log
        return {"engine": self.engine, "rounds": self.rounds, "episodes": self.log, "checks": self.checks}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_chaos_never_under_reports_and_completes_with_the_uninterrupted_model(tmp_path, small_disk):
    trials = int(os.environ.get("RFEDRAY_CHAOS_TRIALS", "30"))
    references = {}
    for rounds in (10, 14, 18):
        done = subprocess.run([sys.executable, "-m", "rfedray.cli", "run", *JOB, f"run.rounds={rounds}", "run.engine=local",
                               f"run.output_dir={tmp_path / 'reference'}", "--quiet"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        references[rounds] = torch.load(Path(done.stdout.strip()) / "model_final.pt", weights_only=True)
    disk = small_disk("2m")
    started = time.monotonic()
    report = []
    for index in range(trials):
        trial_tmp = tmp_path / f"trial-{index}"
        trial_tmp.mkdir()
        shutil.rmtree(disk / "runs", ignore_errors=True)
        report.append(Trial(index, trial_tmp, disk, references).run())
        print(f"trial {index}: {json.dumps(report[-1])}", flush=True)  # progress, with -s
    actions = collections.Counter(a for r in report for a in r["episodes"])
    print("\nchaos:", json.dumps({"trials": trials, "checks": sum(r["checks"] for r in report), "actions": actions,
                                  "seconds": round(time.monotonic() - started)}, indent=1))
    assert sum(r["checks"] for r in report) >= 2 * trials
