"""Chaos test of the run directory (slow): kill, corrupt, fill and race a run over many seeded trials.

Each trial runs one seeded job to completion through a sequence of episodes (the first a new run,
the others ``--resume``). An episode may first damage the run directory as an operator would (put
back an older ``budget.json``; delete ``budget.json``, ``checkpoint.pt`` or ``metrics.jsonl``),
then starts the run and disrupts it at a random round: SIGKILL or SIGTERM the driver; on the Ray
engine, kill the server actor, a client actor or the accountant actor (their processes, by pid;
Ray restarts the last two and the run goes on, so they are killed again at later rounds); fill the disk (the run directory is on a real 2 MiB tmpfs); start two resumes at once.

A trial on the Ray engine runs on a Ray head of its own (``scripts/chaos_soak.py``'s ``RayHead``,
given as ``RAY_ADDRESS``, with the trial's environment so that its actors load the side channels
below): on a cluster the server and the accountant are separate actors (a driver that starts Ray
itself runs them in its own process). The actors killed are that head's processes, found as its
descendants; the head outlives each driver (what a killed driver leaves there is Ray's to clean up,
and the run directory's writer token keeps it out of the next episode) and is killed, with
everything under it, when the trial ends.

Every fault kind is drawn: trial ``i`` features kind ``FAULTS[i % 11]`` (on the Ray engine for the
actor kills, and for the other disruptions in odd cycles of 11 trials), which it applies in every
other episode (a damage: in every episode); the other episodes draw a disruption at random (seeded
by the trial), and sometimes a damage. A fault counts when it took effect (a kill that reached a
live process, a damage the resume saw).

Counted independently of the run (``tests/chaos/sitecustomize.py``, loaded by every process of the
run, Ray actors included): the releases (``round client`` each time a client's local training
returned a submission) and, for each round, the clients whose submissions the server combined.

Invariant, checked after every episode: every client's participations in ``budget.json`` are at
least its counted releases, and the epsilon the run reports (``budget.json``'s, and
``summary.json``'s once the run ends) is at least the epsilon of the counted releases (computed
by the same accountant from the counts). Whenever a trial's run completes, its final model equals
the uninterrupted run's, bit for bit; where a killed client actor made clients dropouts of a round
the run kept, it equals a local run with the same dropouts.

``RFEDRAY_CHAOS_TRIALS`` sets the number of trials (default 11: each kind featured once),
``RFEDRAY_CHAOS_MIN_EACH`` how many times each kind must have taken effect (default 1),
``RFEDRAY_CHAOS_FIRST`` the first trial's index (default 0: to replay a failed trial); the report
is printed with ``-s``. The long run (each kind at least 5 times; 33 trials took 34 minutes on a
shared 2-core machine)::

    RFEDRAY_CHAOS_TRIALS=33 RFEDRAY_CHAOS_MIN_EACH=5 nice -n 10 .venv/bin/python -m pytest -m slow \\
        tests/test_chaos_rundir.py -s -p no:cacheprovider
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
from rfedray.federated.server import cohort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from chaos_soak import RayHead  # noqa: E402
N_CLIENTS, COHORT, SEED = 6, 3, 0
JOB = [
    "run.checkpoint_every=4", f"federation.n_clients={N_CLIENTS}", f"federation.clients_per_round={COHORT}",
    "federation.local_steps=2", "federation.batch_size=10", "data.options.d=6", "data.options.p=2",
    "data.options.records_per_client=40", "privacy.noise_seed=1", f"run.seed={SEED}", "privacy.epsilon=null",
    "privacy.sigma=0.5", "monitoring.progress=false", "ray.num_client_actors=2",
]
DAMAGE = ("older_budget", "delete_budget", "delete_checkpoint", "delete_metrics")
"""Done to the run directory before a resume."""
DISRUPTIONS = ("kill_driver", "sigterm", "fill_disk", "concurrent", "kill_server", "kill_client", "kill_accountant")
"""Done to a run while it goes (the actor kills on the Ray engine only)."""
FAULTS = DAMAGE + DISRUPTIONS
ACTOR = {"kill_server": "ray::ServerActor", "kill_client": "ray::ClientActor", "kill_accountant": "ray::AccountantActor"}
MAX_EPISODES = 6


def environment(tmp: Path, fail: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "chaos"), str(ROOT), env.get("PYTHONPATH", "")])
    env["RFEDRAY_CHAOS_RELEASES"] = str(tmp / "releases.txt")
    env["RFEDRAY_CHAOS_AGGREGATED"] = str(tmp / "aggregated.txt")
    env["RFEDRAY_CHAOS_FAIL"] = fail
    env["PYTHONWARNINGS"] = "ignore"
    return env


def cli(args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rfedray.cli", *args, "--quiet"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def start(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rfedray.cli", *args, "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def rounds_logged(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"round_seconds"' in line)
    except OSError:
        return 0


def wait_rounds(processes, run_dir: Path, after: int, timeout=240.0) -> bool:
    """Wait until ``after`` more rounds are logged; whether a process is still running then."""
    target = rounds_logged(run_dir) + after
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes) and rounds_logged(run_dir) < target and time.monotonic() < deadline:
        time.sleep(0.02)
    return any(p.poll() is None for p in processes)


def kill_actor(driver: subprocess.Popen, head: RayHead, name: str, rng: random.Random, timeout: float = 10.0) -> bool:
    """SIGKILL one of ``head``'s processes whose title names ``name``, while ``driver`` runs
    (waiting up to ``timeout`` for one, e.g. while Ray restarts it); whether one was."""
    deadline = time.monotonic() + timeout
    while driver.poll() is None and time.monotonic() < deadline:
        found = head.processes(name)
        if found:
            try:
                rng.choice(found).kill()
                return True
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    return False


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a driver (unless it ended), then whatever of its process group is left (the Ray
    processes a local-engine driver started; the group's id stays taken while one of them lives)."""
    if process.poll() is None:
        process.kill()
    process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Trial:
    """One seeded job run to completion through chaos episodes, with the invariant checked after each."""

    def __init__(self, index: int, tmp: Path, disk: Path, references: dict):
        self.rng = random.Random(index)
        self.featured = FAULTS[index % len(FAULTS)]
        odd_cycle = (index // len(FAULTS)) % 2 == 1
        self.engine = "ray" if self.featured in ACTOR or (odd_cycle and self.featured in DISRUPTIONS) else "local"
        self.rounds = self.rng.choice([10, 14, 18])
        self.tmp, self.disk, self.references = tmp, disk, references
        self.env = environment(tmp)
        self.head: RayHead | None = None
        self.run_dir: Path | None = None
        self.snapshots: list[bytes] = []
        self.log: list[str] = []
        self.happened: collections.Counter = collections.Counter()
        self.checks = 0

    def job(self, engine: str = "") -> list[str]:
        return [*JOB, f"run.rounds={self.rounds}", f"run.engine={engine or self.engine}"]

    # ----- what happened, counted by the test ---------------------------------------------------

    def released(self) -> list[int]:
        """Each client's releases: how many times its local training returned a submission."""
        path = self.tmp / "releases.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        counts = collections.Counter(int(line.split()[1]) for line in lines if line.strip())
        return [counts[c] for c in range(N_CLIENTS)]

    def kept(self) -> dict[int, list[int]]:
        """For each round, the clients whose submissions went into the update the run kept (its last execution)."""
        kept = {}
        for line in (self.tmp / "aggregated.txt").read_text().splitlines():
            round_index, *clients = (int(v) for v in line.split())
            kept[round_index] = clients
        return kept

    def epsilon_of(self, participations: list[int]) -> float:
        fed = Federation.prepare(load_config(None, self.job("local")), RunDirectory(self.tmp))
        ledger = fed.make_ledger()
        ledger.load_state_dict(dict(ledger.state_dict(), participations=participations, epsilon_spent=0.0))
        return ledger.epsilon_spent()

    # ----- the invariant ------------------------------------------------------------------------

    def check(self) -> None:
        """Reported epsilon never below the epsilon of the releases that happened."""
        released = self.released()
        floor = self.epsilon_of(released)
        budget = json.loads((self.run_dir / "budget.json").read_text())["ledger"]
        assert all(p >= r for p, r in zip(budget["participations"], released)), (budget["participations"], released, self.log)
        assert budget["epsilon_spent"] >= floor - 1e-12, (budget["epsilon_spent"], floor, self.log)
        if self.completed():
            assert json.loads((self.run_dir / "summary.json").read_text())["epsilon_spent"] >= floor - 1e-12, self.log
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
        if self.run_dir is None:  # a new run prints its directory first (nothing when refused at once)
            printed = process.stdout.readline().strip()
            self.run_dir = Path(printed) if printed else None
        return process

    def choose(self, episode: int) -> tuple[str, str]:
        """This episode's (damage, disruption): the featured kind every other episode (a featured
        damage: every episode, followed by a disruption that stops the run), else drawn; mostly one
        that stops the run, so that the trial goes on to its next episode."""
        possible = [d for d in DISRUPTIONS if d not in ACTOR or self.engine == "ray"]
        stopping = [d for d in ("kill_driver", "sigterm", "kill_server") if d in possible]
        if self.run_dir is None:  # a new run: nothing to damage, nobody to race
            possible.remove("concurrent")
            if self.featured in possible:
                return "", self.featured
            return "", self.rng.choice(stopping)
        damage = ""
        if self.featured in DAMAGE:
            damage = self.featured
        elif self.rng.random() < 0.25:
            damage = self.rng.choice(DAMAGE)
        if self.featured in DISRUPTIONS and episode % 2 == 0:
            return damage, self.featured
        if episode < MAX_EPISODES - 1 and (self.featured in DAMAGE or self.rng.random() < 0.7):
            return damage, self.rng.choice(stopping)
        return damage, self.rng.choice(possible + ["none"] if self.rng.random() < 0.1 else possible)

    def refused(self, damage, restore, expect: str) -> None:
        """An operator's damage before a resume: it must be refused (exit 2), writing nothing; then repaired."""
        damage()
        done = cli(self.command(), self.env, timeout=300)
        restore()
        assert done.returncode == 2 and expect in done.stderr and "Traceback" not in done.stderr, (done.stderr, self.log)

    def damage(self, kind: str) -> None:
        budget = self.run_dir / "budget.json"
        if kind == "older_budget":
            current = budget.read_bytes()
            older = [s for s in self.snapshots if s != current]
            if older:
                self.refused(lambda: budget.write_bytes(self.rng.choice(older)), lambda: budget.write_bytes(current),
                             "is older than what this run released")
                self.happened[kind] += 1
        elif kind in ("delete_budget", "delete_checkpoint"):
            path = budget if kind == "delete_budget" else self.run_dir / "checkpoint.pt"
            kept = path.read_bytes()
            self.refused(path.unlink, lambda: path.write_bytes(kept), "is missing" if kind == "delete_budget" else "no checkpoint.pt")
            self.happened[kind] += 1
        elif kind == "delete_metrics":
            if (self.run_dir / "metrics.jsonl").exists():
                (self.run_dir / "metrics.jsonl").unlink()
                self.happened[kind] += 1

    def disrupt(self, kind: str, last: bool) -> None:
        after = self.rng.randint(1, 4)
        if kind == "concurrent":
            racers = [self.launch(), self.launch()]
            if not last and wait_rounds(racers, self.run_dir, after):
                deadline = time.monotonic() + 120  # the one refused exits on its own first
                while all(r.poll() is None for r in racers) and time.monotonic() < deadline:
                    time.sleep(0.05)
                for racer in racers:
                    kill_group(racer)
            results = [(r.communicate(timeout=600)[1], r.returncode)[::-1] for r in racers]
            codes = [code for code, _ in results]
            assert all("Traceback" not in err for _, err in results), (results, self.log)
            # One writer: the other is refused (exit 2), unless the first had already finished.
            assert set(codes) <= {0, 2, -9} and (2 in codes or self.completed()), (results, self.log)
            self.happened[kind] += 1
            return
        filler = None
        if kind == "fill_disk":
            filler = self.disk / "filler"
            with open(filler, "wb") as fh:
                fh.write(b"\0" * max(0, shutil.disk_usage(self.disk).free - self.rng.randint(5_000, 120_000)))
            self.happened[kind] += 1
        process = self.launch()
        if self.run_dir is None:  # refused before it made its directory (the disk is full)
            _, err = process.communicate(timeout=600)
            assert process.returncode == 1 and "Traceback" not in err, (process.returncode, err, self.log)
            if filler is not None:
                filler.unlink()
            self.happened["disk_full_stops"] += 1
            return
        if kind in ("kill_driver", "sigterm") and wait_rounds([process], self.run_dir, after):
            os.kill(process.pid, signal.SIGKILL if kind == "kill_driver" else signal.SIGTERM)
            self.happened[kind] += 1
        elif kind in ACTOR:
            # Ray restarts a killed client or accountant actor and the run goes on: kill it again
            # later, and sometimes the driver after that (its dropouts then precede a resume).
            for _ in range(1 if kind == "kill_server" else self.rng.randint(2, 4)):
                if not wait_rounds([process], self.run_dir, after):
                    break
                if kill_actor(process, self.head, ACTOR[kind], self.rng):
                    self.happened[kind] += 1
                else:
                    self.log.append(f"{kind}: no such process")
                after = self.rng.randint(1, 3)
            if kind != "kill_server" and not last and self.rng.random() < 0.5 and wait_rounds([process], self.run_dir, after):
                os.kill(process.pid, signal.SIGKILL)
                self.log.append("+kill_driver")
                self.happened["kill_driver"] += 1
                kind = "kill_driver"
        _, err = process.communicate(timeout=600)
        if kind == "kill_driver":
            kill_group(process)
        assert "Traceback" not in err, (err, self.log)
        assert process.returncode in (0, 1, 2, 143, -9), (process.returncode, err, self.log)
        if filler is not None:
            filler.unlink()
            if process.returncode == 1:  # the full disk stopped the run: one error line
                assert "No space left on device" in err or "is full" in err, (err, self.log)
                self.log.append("disk full: exit 1")
                self.happened["disk_full_stops"] += 1

    def episode(self, index: int) -> None:
        damage, disruption = self.choose(index)
        self.log.append("+".join(filter(None, (damage, disruption))))
        if damage:
            self.damage(damage)
        self.disrupt(disruption, last=index == MAX_EPISODES - 1)
        budget = self.run_dir / "budget.json" if self.run_dir is not None else None
        if budget is not None and budget.is_file():
            self.snapshots.append(budget.read_bytes())
            self.check()

    def run(self) -> dict:
        """Run the trial's episodes and finish the run (on a Ray head of its own for the Ray engine,
        killed at the end); its report."""
        if self.engine == "ray":
            self.head = RayHead(self.tmp / "ray-head.log", self.env, num_cpus=4)
            self.env = self.head.env
        try:
            return self.episodes()
        finally:
            if self.head is not None:
                self.head.stop()

    def episodes(self) -> dict:
        for index in range(MAX_EPISODES):
            self.episode(index)
            if self.run_dir is None or not (self.run_dir / "checkpoint.pt").exists():
                self.log.append("restart")  # refused before its first checkpoint (no room): start again
                self.run_dir = None
                continue
            if self.completed():
                break
        while not self.completed():  # chaos over: finish the run
            self.log.append("finish")
            done = cli(self.command(), self.env)
            assert done.returncode == 0, (done.stderr, self.log)
        self.check()
        self.check_model()
        return {"featured": self.featured, "engine": self.engine, "rounds": self.rounds, "episodes": self.log,
                "happened": dict(self.happened), "checks": self.checks}

    def check_model(self) -> None:
        """The final model is the uninterrupted run's, or a local run's with the same dropouts."""
        kept = self.kept()
        assert sorted(kept) == list(range(self.rounds)), (sorted(kept), self.log)
        releases = (self.tmp / "releases.txt").read_text().split("\n")
        assert all(f"{r} {c}" in releases for r, clients in kept.items() for c in clients), "a release went uncounted"
        dropouts = {r: sorted(set(cohort(SEED, r, N_CLIENTS, COHORT)) - set(kept[r])) for r in kept}
        dropouts = {r: clients for r, clients in dropouts.items() if clients}
        final = torch.load(self.run_dir / "model_final.pt", weights_only=True)
        if dropouts:
            self.log.append(f"dropouts {dropouts}")
            replay = self.tmp / "replay"
            replay.mkdir()
            fail = ";".join(f"{r}:{','.join(map(str, c))}" for r, c in sorted(dropouts.items()))
            done = cli(["run", *self.job("local"), f"run.output_dir={replay}"], environment(replay, fail))
            assert done.returncode == 0, done.stderr
            reference = torch.load(Path(done.stdout.strip()) / "model_final.pt", weights_only=True)
        else:
            reference = self.references[self.rounds]
        assert all(torch.equal(final[k], reference[k]) for k in reference), self.log


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_chaos_never_under_reports_and_completes_with_the_uninterrupted_model(tmp_path, small_disk):
    trials = int(os.environ.get("RFEDRAY_CHAOS_TRIALS", str(len(FAULTS))))
    min_each = int(os.environ.get("RFEDRAY_CHAOS_MIN_EACH", "1"))
    first = int(os.environ.get("RFEDRAY_CHAOS_FIRST", "0"))
    references = {}
    for rounds in (10, 14, 18):
        done = cli(["run", *JOB, f"run.rounds={rounds}", "run.engine=local", f"run.output_dir={tmp_path / 'reference'}"],
                   {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, timeout=300)
        assert done.returncode == 0, done.stderr
        references[rounds] = torch.load(Path(done.stdout.strip()) / "model_final.pt", weights_only=True)
    disk = small_disk("2m")
    started = time.monotonic()
    report = []
    for index in range(first, first + trials):
        trial_tmp = tmp_path / f"trial-{index}"
        trial_tmp.mkdir()
        shutil.rmtree(disk / "runs", ignore_errors=True)
        report.append(Trial(index, trial_tmp, disk, references).run())
        print(f"trial {index}: {json.dumps(report[-1])}", flush=True)  # progress, with -s
    happened = sum((collections.Counter(r["happened"]) for r in report), collections.Counter())
    print("\nchaos:", json.dumps({"trials": trials, "checks": sum(r["checks"] for r in report),
                                  "engines": collections.Counter(r["engine"] for r in report),
                                  "faults": {k: happened[k] for k in FAULTS},
                                  "disk_full_stops": happened["disk_full_stops"],
                                  "seconds": round(time.monotonic() - started)}, indent=1))
    assert sum(r["checks"] for r in report) >= 2 * trials
    if trials >= len(FAULTS):
        assert all(happened[k] >= min_each for k in FAULTS), {k: happened[k] for k in FAULTS}
