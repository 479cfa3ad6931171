"""The run directory as a transaction (issue 17): a ledger that never goes back, one writer at a
time, every failure resumable.

Each test is an operator's action or an environment failure that today's code must survive:
an older ``budget.json`` put back, ``budget.json`` lost, two resumes at once, a full disk, a run
killed before its first checkpoint, SIGTERM, a killed driver and the Ray processes it started.
Runs go through the real CLI (``python -m rfedray.cli``) in a process of their own.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from rfedray.federated.rundir import RunDirectory
from rfedray.federated.storage import LocalStore

from small_job import SMALL_JOB

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "rfedray.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=kwargs.pop("timeout", 300), env=dict(env, PYTHONWARNINGS="ignore"), **kwargs)


def start(*args) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "rfedray.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(env, PYTHONWARNINGS="ignore"),
                            start_new_session=True)


def new_run(out: Path, *overrides) -> Path:
    done = cli("run", *SMALL_JOB, f"run.output_dir={out}", *overrides)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[0])


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a failed command (the run's own warnings may come before it)."""
    lines = [line for line in done.stderr.strip().splitlines() if line]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in done.stderr, done.stderr
    assert all(line.startswith(("WARNING ", "error: ", "round ")) for line in lines), done.stderr
    assert "backup" not in errors[0]
    return errors[0]


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


def model(run_dir: Path) -> dict:
    return torch.load(run_dir / "model_final.pt", weights_only=True)


def same_model(a: Path, b: Path) -> bool:
    ma, mb = model(a), model(b)
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def charges(run_dir: Path) -> int:
    return json.loads((run_dir / "budget.json").read_text())["ledger"]["charges"]


def wait_for(condition, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def rounds_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"round_seconds"' in line) if path.exists() else 0


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run stopped after 3 rounds (``budget.json`` saved then, as an operator's backup), then resumed to 12."""
    out = tmp_path_factory.mktemp("runs")
    run_dir = new_run(out, "run.rounds=3")
    backup = {name: data for name, data in files(run_dir).items()}
    resumed = cli("run", "--resume", str(run_dir), "run.rounds=12", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    return run_dir, backup


def copy_of(finished, tmp_path) -> Path:
    run_dir, _ = finished
    target = tmp_path / run_dir.name
    shutil.copytree(run_dir, target)
    return target


# ----- a ledger that only grows ---------------------------------------------------------------

def test_an_older_budget_put_back_is_refused(finished, tmp_path):
    """Row 1: today the resume loads the round-3 ledger and reports epsilon 0.69 where 0.94 was owed."""
    run_dir = copy_of(finished, tmp_path)
    (run_dir / "budget.json").write_bytes(finished[1]["budget.json"])
    before = files(run_dir)
    done = cli("run", "--resume", str(run_dir), "run.rounds=15", "--quiet")
    assert done.returncode == 2
    line = error_line(done)
    assert "budget.json records 3 charges" in line and "older than what this run released" in line
    assert files(run_dir) == before


def test_older_budget_checkpoint_and_cut_metrics_are_refused(finished, tmp_path):
    """The operator puts back budget.json AND checkpoint.pt of round 3 and cuts metrics.jsonl: the charge log is ahead."""
    run_dir = copy_of(finished, tmp_path)
    for name in ("budget.json", "checkpoint.pt", "metrics.jsonl"):
        (run_dir / name).write_bytes(finished[1][name])
    done = cli("run", "--resume", str(run_dir), "run.rounds=15", "--quiet")
    assert done.returncode == 2
    assert "ledger.jsonl shows 12" in error_line(done)


def test_a_lost_budget_is_refused(finished, tmp_path):
    """Row 2: today the resume silently falls back to the checkpoint's (older) ledger."""
    run_dir = copy_of(finished, tmp_path)
    (run_dir / "budget.json").unlink()
    done = cli("run", "--resume", str(run_dir), "run.rounds=15", "--quiet")
    assert done.returncode == 2
    assert "budget.json is missing" in error_line(done)


def test_a_cut_charge_log_is_refused(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    log = (run_dir / "ledger.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "ledger.jsonl").write_text("".join(log[:6]))
    done = cli("run", "--resume", str(run_dir), "run.rounds=15", "--quiet")
    assert done.returncode == 2
    assert "ledger.jsonl ends at charge 5 but budget.json records 12" in error_line(done)


def test_every_trace_carries_the_ledger_sequence(finished):
    """The checkpoint, every metrics line, budget.json and the hash-chained charge log agree on 12 charges."""
    run_dir, _ = finished
    assert charges(run_dir) == 12
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["ledger"]["charges"] == 12 and state["round"] == 12
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["ledger_charges"] for r in rounds if "event" not in r] == list(range(1, 13))
    chain = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [e["charge"] for e in chain] == list(range(13)) and [e["round"] for e in chain[1:]] == list(range(12))


def test_charges_after_the_checkpoint_are_kept_and_charged_again(tmp_path):
    """Killed at round 8 (checkpoint at 5): rounds 5-7 were released, so the resume charges them again."""
    run = start("run", *SMALL_JOB, f"run.output_dir={tmp_path}",
                "run.rounds=40", "federation.local_steps=200")
    run_dir = Path(run.stdout.readline().strip())
    wait_for(lambda: rounds_logged(run_dir) >= 8, what="round 8")
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    released = charges(run_dir)
    assert released >= 8
    done = cli("run", "--resume", str(run_dir), "run.rounds=12", "federation.local_steps=200", "--quiet")
    assert done.returncode == 0, done.stderr
    assert charges(run_dir) == released + 12 - 5


# ----- one writer ---------------------------------------------------------------------------

def test_a_second_resume_is_refused_naming_the_holder(finished, tmp_path):
    """Row 3: today both resumes exit 0 and metrics.jsonl interleaves two processes' rounds."""
    run_dir = copy_of(finished, tmp_path)
    # The first resume holds the directory for its rounds and then 30 s more (its metrics endpoint
    # lingers): long enough for the second to start on a loaded machine.
    first = start("run", "--resume", str(run_dir), "run.rounds=40", "monitoring.metrics_port=0",
                  "monitoring.linger_seconds=30", "--quiet")
    wait_for(lambda: '"released": false' in (run_dir / ".lock").read_text() and str(first.pid) in (run_dir / ".lock").read_text(),
             what="the first resume to hold the lock")
    second = cli("run", "--resume", str(run_dir), "run.rounds=40", "--quiet")
    assert second.returncode == 2
    line = error_line(second)
    assert "another rfedray process is writing this run directory" in line
    assert f"pid {first.pid}" in line and f"host {os.uname().nodename}" in line and "started 20" in line
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    rounds = [r["round"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    assert rounds == list(range(40))
    assert charges(run_dir) == 12 + 28
    assert json.loads((run_dir / ".lock").read_text())["released"] is True


def test_the_lock_is_free_once_its_holder_is_killed(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from rfedray.federated.rundir import RunDirectory; "
        f"rd = RunDirectory({str(run_dir)!r}); lock = rd.lock(); rd.announce(lock, 'test'); print('held', flush=True); "
        "time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(Exception, match=f"pid {holder.pid}"):
        RunDirectory(run_dir).lock()
    holder.kill()
    holder.wait()
    lock = RunDirectory(run_dir).lock()
    assert lock.previous_holder_died() and lock.previous["pid"] == holder.pid
    lock.release()


def test_a_writer_stops_once_another_process_took_the_directory_over(tmp_path):
    """A process that outlived its driver (a Ray actor) must not write after a resume took over."""
    from rfedray.federated.rundir import RunDirectoryWriteError

    (tmp_path / "run").mkdir()
    first = RunDirectory(tmp_path / "run")
    lock = first.lock()
    first.announce(lock, "first")
    first.append_metrics({"round": 0})
    lock.release()
    second = RunDirectory(tmp_path / "run")
    second.announce(second.lock(), "second")
    with pytest.raises(RunDirectoryWriteError, match="another process took this run directory over"):
        first.append_metrics({"round": 1})
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


# ----- a takeover between a writer's check and its write -------------------------------------

FINGERPRINT = {"test": "takeover"}


def _ledger():
    from rfedray.privacy.accountants import ExactAccountant
    from rfedray.privacy.ledger import PrivacyLedger
    from rfedray.privacy.plan import GaussianMechanism

    return PrivacyLedger(ExactAccountant(), GaussianMechanism(0.5, 1.0, 10), local_steps=2, delta=1e-5,
                         epsilon_target=None, client_sizes=[40] * 4)


def _old_writer(tmp_path):
    """A run whose driver died after round 0's charge: its writer (a Ray actor) lives on, with its token."""
    from rfedray.federated.resume import WriteAheadLedger

    (tmp_path / "run").mkdir()
    old = RunDirectory(tmp_path / "run")
    lock = old.lock()
    old.announce(lock, "first")
    wal = WriteAheadLedger(_ledger(), FINGERPRINT, old)
    wal.start()
    granted = [wal.authorize([0, 1], round=0, request="r0")]
    assert granted[0].granted
    lock.release()  # the driver is killed: the kernel releases its flock
    return old, wal, granted


def _take_over_during(monkeypatch, old, method, file, after=None, before=None):
    """Make ``old``'s next ``method`` of ``file`` let a resume lock, announce and load the ledger
    between the writer's check and its write (``before(wal)`` then runs with the resume's ledger,
    e.g. charging a round, and the resume's driver dies, releasing its lock; ``after()`` runs after
    the old writer's write, e.g. the writer dying)."""
    from rfedray.federated.resume import WriteAheadLedger

    resumed = {}
    original = getattr(old.store, method)

    def racing(name, data):
        if name == file and not resumed:
            new = RunDirectory(old.path)
            lock = new.lock()
            new.announce(lock, "rfedray run --resume")
            resumed["wal"] = WriteAheadLedger(_ledger(), FINGERPRINT, new)
            if before is not None:
                before(resumed["wal"])
                lock.release()
            original(name, data)
            if after is not None:
                after()
            return
        original(name, data)

    monkeypatch.setattr(old.store, method, racing)
    return resumed


def _counted(resumed, granted):
    """The resumed ledger counts every granted charge: its epsilon is at least each grant's."""
    spent = resumed["wal"].epsilon_spent()
    assert all(spent >= auth.epsilon_after for auth in granted if auth.granted), (spent, granted)


@pytest.mark.parametrize("method, file", [("write_atomic", "budget.json"), ("append", "ledger.jsonl")])
def test_a_writer_taken_over_between_its_check_and_its_write_grants_nothing(tmp_path, monkeypatch, method, file):
    """A resume that takes the run over while the old writer persists a charge: the old writer
    refuses the charge (its cohort does not train), and the resume counts every charge granted."""
    from rfedray.federated.rundir import RunDirectoryWriteError

    old, wal, granted = _old_writer(tmp_path)
    resumed = _take_over_during(monkeypatch, old, method, file)
    with pytest.raises(RunDirectoryWriteError, match="another process took this run directory over"):
        granted.append(wal.authorize([2, 3], round=1, request="r1"))
    _counted(resumed, granted)


def test_a_restarted_writer_does_not_replay_a_grant_after_a_takeover(tmp_path, monkeypatch):
    """The old writer's charge lands after the resume read budget.json and the writer dies before
    answering; Ray restarts it and re-sends the request: the replayed grant must be refused too."""
    from rfedray.federated.resume import WriteAheadLedger
    from rfedray.federated.rundir import RunDirectoryWriteError

    old, wal, granted = _old_writer(tmp_path)

    def die():
        raise KeyboardInterrupt("the actor's process dies")

    resumed = _take_over_during(monkeypatch, old, "write_atomic", "budget.json", after=die)
    with pytest.raises(KeyboardInterrupt):
        wal.authorize([2, 3], round=1, request="r1")
    monkeypatch.undo()
    restarted = WriteAheadLedger(_ledger(), FINGERPRINT, RunDirectory(old.path, old.writer_token))
    with pytest.raises(RunDirectoryWriteError, match="another process took this run directory over"):
        granted.append(restarted.authorize([2, 3], round=1, request="r1"))
    _counted(resumed, granted)


def _third_resume(path):
    """What the next resume of the run loads (after the second driver died too), and its writer."""
    from rfedray.federated.budget import BudgetFiles
    from rfedray.federated.resume import WriteAheadLedger

    rd = RunDirectory(path)
    lock = rd.lock()
    rd.announce(lock, "rfedray run --resume")
    checkpoint = {"round": 0, "ledger": {"charges": 1}}
    try:
        state = BudgetFiles(rd, FINGERPRINT).trusted(checkpoint, [])
        return state, WriteAheadLedger(_ledger(), FINGERPRINT, rd), lock
    except Exception:
        lock.release()
        raise


def test_a_stale_budget_write_landing_after_the_new_writers_charge_is_refused(tmp_path, monkeypatch):
    """The old writer passes its check, stalls, and its budget.json lands after the resume's writer
    charged the same round number to another cohort: that budget.json has as many charges as the
    log and would forget the granted charge. The next resume and a restarted writer refuse it."""
    from rfedray.errors import RfedrayError
    from rfedray.federated.resume import WriteAheadLedger
    from rfedray.federated.rundir import RunDirectoryWriteError

    old, wal, granted = _old_writer(tmp_path)
    new_grants = []
    _take_over_during(monkeypatch, old, "write_atomic", "budget.json",  # the old writer's charge: clients 2, 3 once
                      before=lambda new: new_grants.append(new.authorize([0, 1], round=1, request="new r1")))
    with pytest.raises(RunDirectoryWriteError, match="another process took this run directory over"):
        wal.authorize([2, 3], round=1, request="old r1")
    monkeypatch.undo()
    assert new_grants[0].granted
    stale = json.loads((tmp_path / "run" / "budget.json").read_text())
    assert stale["last"]["cohort"] == [2, 3] and stale["ledger"]["charges"] == 2  # the stale write, the log's count
    forgetful = _ledger()
    forgetful.load_state_dict(stale["ledger"])
    assert forgetful.epsilon_spent() < new_grants[0].epsilon_after  # loading it would under-count
    with pytest.raises(RfedrayError, match="budget.json's last charge is not the last line of ledger.jsonl"):
        _third_resume(old.path)
    with pytest.raises(RfedrayError, match="budget.json's last charge is not the last line of ledger.jsonl"):
        WriteAheadLedger(_ledger(), FINGERPRINT, RunDirectory(old.path))  # the accountant actor restarted


def test_a_line_the_old_writer_appends_twice_is_tolerated(tmp_path, monkeypatch):
    """The old writer passes its append's check and stalls; the resume's writer appends that charge's
    line from budget.json, then its own; the old line lands last, a copy. The chain goes on from the
    first copy: the next resume and its writer continue, counting every grant."""
    from rfedray.federated.rundir import RunDirectoryWriteError

    old, wal, granted = _old_writer(tmp_path)
    _take_over_during(monkeypatch, old, "append", "ledger.jsonl",  # the resume loads the old charge
                      before=lambda new: granted.append(new.authorize([0, 1], round=1, request="new r1")))
    with pytest.raises(RunDirectoryWriteError, match="another process took this run directory over"):
        wal.authorize([2, 3], round=1, request="old r1")
    monkeypatch.undo()
    lines = (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 5 and lines[-1] == lines[2]  # header, r0, old r1, new r1, old r1 again
    state, writer, lock = _third_resume(old.path)
    assert state["charges"] == 3
    _counted({"wal": writer}, granted)
    granted.append(writer.authorize([1, 2], round=2, request="r2"))
    lock.release()
    state, _, _ = _third_resume(old.path)
    assert state["charges"] == 4


def test_a_resume_loads_the_ledger_only_after_announcing_its_token(finished, tmp_path, monkeypatch):
    """The ledger a resume continues from is read under its own announced token (so every grant
    fenced before the announcement is in it); the check before announcing only refuses."""
    from rfedray.federated.budget import BudgetFiles
    from rfedray.runner import resume_config, run

    run_dir = RunDirectory(copy_of(finished, tmp_path))
    tokens, announced = [], []
    current, announce = BudgetFiles.current, RunDirectory.announce

    def recording_current(self):
        tokens.append(self.run_dir.writer_token)
        return current(self)

    def recording_announce(self, lock, command):
        announce(self, lock, command)
        announced.append(self.writer_token)

    monkeypatch.setattr(BudgetFiles, "current", recording_current)
    monkeypatch.setattr(RunDirectory, "announce", recording_announce)
    loads = []
    from rfedray.federated.resume import WriteAheadLedger
    load = WriteAheadLedger.load_state_dict
    monkeypatch.setattr(WriteAheadLedger, "load_state_dict",
                        lambda self, state: (loads.append(self._files.run_dir.writer_token), load(self, state))[1])
    run(resume_config(run_dir, ["run.rounds=13"]), run_dir, quiet=True, resume=True)
    assert len(announced) == 1 and announced[0]
    assert loads == announced  # the ledger the run continues from: loaded once, after announcing
    first_announced = tokens.index(announced[0])
    assert all(token == "" for token in tokens[:first_announced])  # reads before announcing: the check only


# ----- every failure resumable ----------------------------------------------------------------

def test_a_run_killed_before_its_first_checkpoint_resumes(tmp_path):
    """Today: no checkpoint before round run.checkpoint_every, so a run killed before it has spent budget but cannot resume."""
    job = ["run.rounds=300", "run.checkpoint_every=1000"]
    reference = new_run(tmp_path / "ref", *job)
    run = start("run", *SMALL_JOB, f"run.output_dir={tmp_path / 'killed'}", *job)
    run_dir = Path(run.stdout.readline().strip())
    wait_for(lambda: rounds_logged(run_dir) >= 2, what="round 2")
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    released = charges(run_dir)
    assert released >= 2 and torch.load(run_dir / "checkpoint.pt", weights_only=True)["round"] == 0
    done = cli("run", "--resume", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr
    assert same_model(run_dir, reference)
    assert charges(run_dir) == released + 300


def fill(mount: Path, leave: int) -> Path:
    """Fill ``mount`` until ``leave`` bytes are free; return the filler file."""
    filler = mount / "filler"
    free = shutil.disk_usage(mount).free
    with open(filler, "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))
    return filler


@pytest.mark.parametrize("leave", [20_000, 30_000, 100_000, 110_000])
def test_a_full_disk_stops_at_a_checkpoint_and_the_resume_ends_as_an_uninterrupted_run(small_disk, tmp_path, leave):
    """Today: a traceback, .tmp files left, and a full disk at the final checkpoint loses the trained model.

    The amounts of free space stop the run before its first checkpoint (20 kB), at its first (30 kB),
    in round 1 (100 kB) and at round 10 (110 kB).
    """
    calibrated = ["run.rounds=20", "run.checkpoint_every=10", "privacy.epsilon=1.0", "privacy.sigma=null"]
    reference = new_run(tmp_path / "ref", *calibrated)
    tiny_disk = small_disk("600k")
    filler = fill(tiny_disk, leave)
    out = tiny_disk / "runs"
    done = cli("run", *SMALL_JOB, f"run.output_dir={out}", *calibrated)
    if done.returncode == 0:
        pytest.fail(f"the disk did not fill up with {leave} bytes free; choose less")
    assert done.returncode == 1, done.stderr
    line = error_line(done)
    assert "No space left on device" in line or "is full" in line
    left = list(out.iterdir()) if out.exists() else []
    filler.unlink()
    if not left:  # stopped before its first checkpoint: nothing charged, nothing kept
        assert "nothing was charged and the run directory is removed" in line
        run_dir = new_run(out, *calibrated)
    else:
        (run_dir,) = left
        assert f"--resume {run_dir}" in line
        assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        assert charges(run_dir) >= state["ledger"]["charges"]
        resumed = cli("run", "--resume", str(run_dir), "--quiet")
        assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 20 and not summary["halted"]
    assert same_model(run_dir, reference)
    assert summary["epsilon_spent"] == json.loads((reference / "summary.json").read_text())["epsilon_spent"]


def remount_read_only(path: Path, attempts: int = 100) -> None:
    """Make the bind mount at ``path`` read-only. The kernel refuses (EBUSY) while a file under it is
    open for writing, which the running job does now and then: try again until a moment between writes."""
    for _ in range(attempts):
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} could not be remounted read-only in {attempts} attempts")


def test_a_read_only_run_directory_is_one_error_line_and_resumes(tmp_path):
    run = start("run", *SMALL_JOB, f"run.output_dir={tmp_path}", "run.rounds=30", "federation.local_steps=300")
    run_dir = Path(run.stdout.readline().strip())
    wait_for(lambda: rounds_logged(run_dir) >= 6, what="round 6")
    subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=True)
    try:
        remount_read_only(run_dir)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        subprocess.run(["umount", str(run_dir)], check=True)
    assert run.returncode == 1
    line = error_line(subprocess.CompletedProcess(run.args, run.returncode, out, err))
    assert "Read-only file system" in line and f"--resume {run_dir}" in line
    # At most the one write in flight when the folder turned read-only leaves its temporary file
    # (it cannot be removed there); the resume's lock holder removes it.
    assert len(temporaries(run_dir)) <= 1
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["ledger"]["charges"] <= charges(run_dir)
    done = cli("run", "--resume", str(run_dir), "federation.local_steps=300", "--quiet")
    assert done.returncode == 0, done.stderr
    assert not temporaries(run_dir)


def temporaries(run_dir: Path) -> list[str]:
    return [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_the_next_lock_holder_removes_what_an_interrupted_write_left(tmp_path):
    """Taking the lock writes nothing; announcing (about to write) removes left temporaries only."""
    leftover = tmp_path / ".budget.json.0a1b2c3d.tmp"
    leftover.write_bytes(b'{"charges": ')
    (tmp_path / "budget.json").write_bytes(b"{}")
    with LocalStore(tmp_path).lock() as lock:
        assert leftover.exists()
        lock.announce("run")
        assert not leftover.exists()
    assert (tmp_path / "budget.json").read_bytes() == b"{}"
    assert not temporaries(tmp_path)


# ----- signals and the Ray processes --------------------------------------------------------

def ray_run(out: Path) -> tuple[subprocess.Popen, Path, dict[int, float]]:
    """A Ray-engine run in a session of its own, past its second round; its processes (pid: start time)."""
    run = start("run", *SMALL_JOB, "run.engine=ray", "ray.num_client_actors=2", f"run.output_dir={out}", "run.rounds=400",
                "federation.local_steps=50")
    run_dir = Path(run.stdout.readline().strip())
    wait_for(lambda: rounds_logged(run_dir) >= 2, timeout=300, what="round 2 on Ray")
    processes = {p.pid: p.create_time() for p in psutil.Process(run.pid).children(recursive=True)}
    assert len(processes) >= 5, processes  # GCS, raylet, agents, server, client and accountant actors, ...
    return run, run_dir, processes


def left_over(processes: dict[int, float], wait_s: float) -> list[str]:
    """The processes of ``processes`` still running after ``wait_s`` seconds (zombies excluded)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid, started in processes.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:80]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_sigterm_stops_a_ray_run_like_ctrl_c(tmp_path):
    """Today: exit 1 with Ray's crash dump, while SIGINT exits 130 cleanly."""
    run, run_dir, processes = ray_run(tmp_path)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err
    ray_warning = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\tWARNING ")  # Ray's own, e.g. on token authentication
    lines = [line for line in err.strip().splitlines() if not line.startswith(("WARNING ", "round ")) and not ray_warning.match(line)]
    assert lines == [f"terminated (SIGTERM): the run directory keeps the last checkpoint and every charge; continue "
                     f"with rfedray run --resume {run_dir}"], err
    assert left_over(processes, 10) == []
    released = charges(run_dir)
    done_rounds = torch.load(run_dir / "checkpoint.pt", weights_only=True)["round"]
    done = cli("run", "--resume", str(run_dir), "run.engine=local", f"run.rounds={done_rounds + 5}", "--quiet")
    assert done.returncode == 0, done.stderr
    assert charges(run_dir) == released + 5


def test_a_killed_ray_driver_leaves_no_process_behind(tmp_path):
    """Today: Ray's dashboard and runtime-env agents outlive a SIGKILLed driver by a minute."""
    run, run_dir, processes = ray_run(tmp_path)
    run.kill()
    run.wait()
    assert left_over(processes, 10) == []
