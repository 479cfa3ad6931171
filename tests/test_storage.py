"""Runs that survive the head (issue 18, item 7): the run directory on object storage or a shared folder.

Against a real S3-compatible server process on this machine (moto's server mode, from the
registry) and a ``file://`` folder: a run writes its directory there, is killed, and
``rfedray run --resume URL`` continues it from another working directory that holds nothing of
the run (as another machine would); write-ahead holds (the releases counted by the chaos test's
side channel never pass the ledger), an older ``budget.json`` put back is refused, and a second
writer is refused while the first holds the lock object.
"""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from small_job import SMALL_JOB

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with a bucket ``runs``; the environment that reaches it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", PYTHONWARNINGS="ignore")
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "moto server did not start"
            time.sleep(0.2)
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket="runs")
    yield env, client
    server.terminate()
    server.wait(timeout=30)


def cli(env, *args, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rfedray.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def start(env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rfedray.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def get(client, url: str, name: str) -> bytes:
    key = url.removeprefix("s3://runs/") + "/" + name
    return client.get_object(Bucket="runs", Key=key)["Body"].read()


def put(client, url: str, name: str, data: bytes) -> None:
    client.put_object(Bucket="runs", Key=url.removeprefix("s3://runs/") + "/" + name, Body=data)


def model_of(data: bytes) -> dict:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on a local disk."""
    out = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = cli(env, "run", *SMALL_JOB, f"run.output_dir={out}")
    assert done.returncode == 0, done.stderr
    run_dir = Path(done.stdout.strip())
    return torch.load(run_dir / "model_final.pt", weights_only=True), json.loads((run_dir / "summary.json").read_text())


def released_by_client(path: Path) -> list[int]:
    counts = collections.Counter(int(line.split()[1]) for line in path.read_text().splitlines() if line.strip())
    return [counts[c] for c in range(6)]


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_a_run_on_s3_killed_and_resumed_from_elsewhere_ends_as_the_uninterrupted_run(s3, reference, tmp_path, engine):
    env, client = s3
    releases = tmp_path / "releases.txt"
    watched = dict(env, RFEDRAY_CHAOS_RELEASES=str(releases),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "chaos"), str(ROOT)]))
    run = start(watched, "run", *SMALL_JOB, f"run.engine={engine}", "run.output_dir=s3://runs/shared", "run.rounds=400",
                "federation.local_steps=2")
    url = run.stdout.readline().strip()
    assert url.startswith("s3://runs/shared/fedpca-")
    deadline = time.monotonic() + 300
    while b'"round": 6' not in _maybe(client, url, "metrics.jsonl") and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    # Write-ahead on object storage: every release that happened is in the ledger.
    budget = json.loads(get(client, url, "budget.json"))["ledger"]
    assert all(p >= r for p, r in zip(budget["participations"], released_by_client(releases)))
    # Another machine: a working directory with nothing of the run, only the URL. A crashed
    # holder's lock object is stale once its heartbeat is old: take it over by backdating it.
    lock = json.loads(get(client, url, ".lock"))
    put(client, url, ".lock", json.dumps(dict(lock, heartbeat=lock["heartbeat"] - 3600)).encode())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = cli(env, "run", "--resume", url, "run.rounds=12" if _done_rounds(client, url) <= 12 else "run.rounds=400",
               f"run.engine={engine}", "--quiet", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert list(elsewhere.iterdir()) == []
    summary = json.loads(get(client, url, "summary.json"))
    if summary["rounds_completed"] == 12:
        model = model_of(get(client, url, "model_final.pt"))
        assert all(torch.equal(model[k], reference[0][k]) for k in model)
        assert summary["epsilon_spent"] >= reference[1]["epsilon_spent"]
    chain = [json.loads(line) for line in get(client, url, "ledger.jsonl").decode().splitlines()]
    assert [e["charge"] for e in chain] == list(range(len(chain)))
    assert chain[-1]["charge"] == json.loads(get(client, url, "budget.json"))["ledger"]["charges"]


def _maybe(client, url, name) -> bytes:
    try:
        return get(client, url, name)
    except client.exceptions.NoSuchKey:
        return b""


def _done_rounds(client, url) -> int:
    return model_of(get(client, url, "checkpoint.pt"))["round"]


def test_an_older_budget_on_s3_is_refused_and_a_second_writer_too(s3, tmp_path):
    env, client = s3
    first = cli(env, "run", *SMALL_JOB, "run.rounds=3", "run.output_dir=s3://runs/refuse")
    assert first.returncode == 0, first.stderr
    url = first.stdout.strip()
    older = get(client, url, "budget.json")
    assert cli(env, "run", "--resume", url, "run.rounds=8", "--quiet").returncode == 0
    put(client, url, "budget.json", older)
    done = cli(env, "run", "--resume", url, "run.rounds=10", "--quiet")
    assert done.returncode == 2
    assert "budget.json records 3 charges but" in done.stderr and "shows 8" in done.stderr and "Traceback" not in done.stderr
    # A live holder (fresh heartbeat) refuses a second writer, naming it.
    holder = {"host": "head-node", "pid": 4242, "started": time.time() - 60, "heartbeat": time.time(), "token": "x",
              "released": False}
    put(client, url, ".lock", json.dumps(holder).encode())
    done = cli(env, "run", "--resume", url, "run.rounds=10", "--quiet")
    assert done.returncode == 2
    assert "another rfedray process is writing this run directory (host head-node, pid 4242" in done.stderr


def test_a_shared_folder_by_file_url(tmp_path, reference):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    shared = tmp_path / "shared"
    run = start(env, "run", *SMALL_JOB, f"run.output_dir=file://{shared}", "run.rounds=400")
    run_dir = Path(run.stdout.readline().strip())
    assert run_dir.parent == shared
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text().count("\n") < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = cli(env, "run", "--resume", f"file://{run_dir}", "run.rounds=12", "--quiet", cwd=elsewhere)
    if torch.load(run_dir / "checkpoint.pt", weights_only=True)["round"] > 12:
        pytest.fail("the run passed round 12 before it was killed; kill it earlier")
    assert done.returncode == 0, done.stderr
    model = torch.load(run_dir / "model_final.pt", weights_only=True)
    assert all(torch.equal(model[k], reference[0][k]) for k in model)
