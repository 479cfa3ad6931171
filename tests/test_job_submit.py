"""Issue 9: ``ray job submit`` of ``rfedray run`` to a real two-node Ray cluster on loopback.

The commands are those of deploy/README.md (section *Try it on one machine*), with free ports (also
where Ray's defaults are fixed numbers, so that other Ray instances on the machine do not collide): a
head node (1 CPU, resource ``head``, with the dashboard that serves the job API) and a second node
(2 CPUs, resource ``worker``) started with ``ray start`` from the repository root, so that the job
runs there; the run is submitted with ``ray job submit``. Ray 2.60's token authentication is on, set
up as a user would: a token made by ``ray get-auth-token --generate`` (in the test's own HOME) and
``RAY_AUTH_MODE=token`` for every command.

Each node runs ``ray start --block`` in its own session; the test stops both by signalling every
process of their trees (``ray stop`` would stop every Ray instance on the machine).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from prometheus_server import free_port
from rfedray.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RUN = ["run.rounds=3", "federation.local_steps=2", "data.options.records_per_client=200", "ray.address=auto",
       "ray.num_client_actors=2", "ray.placement=SPREAD"]
NODE_START_TIMEOUT_S = 120


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM a ``ray start --block`` and every process under it, then SIGKILL what is left after 3 s."""
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for signal_all in (psutil.Process.terminate, psutil.Process.kill):
        for p in tree:
            try:
                signal_all(p)
            except psutil.NoSuchProcess:
                pass
        _, tree = psutil.wait_procs(tree, timeout=3)
    proc.wait(timeout=5)


class LoopbackCluster:
    """Two Ray nodes on this machine, started with the ``ray`` command line.

    Parameters
    ----------
    workdir : Path
        Holds HOME (with the token) and the nodes' logs.
    temp_dir : Path
        The nodes' ``--temp-dir`` (short: Ray's socket paths must stay under 108 characters).
    """

    def __init__(self, workdir: Path, temp_dir: Path):
        self.workdir, self.temp_dir = workdir, temp_dir
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(HOME=str(workdir / "home"), RAY_AUTH_MODE="token", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        self.port, self.dashboard_port = free_port(), free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.nodes: list[subprocess.Popen] = []

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ray", *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def start_node(self, name: str, *args: str) -> None:
        """``ray start ARGS --block`` in its own session; return once the node says it started."""
        log = self.workdir / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["ray", "start", *args, f"--temp-dir={self.temp_dir}", "--disable-usage-stats", "--block"],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.nodes.append(proc)
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start ({name}) exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"ray start ({name}) did not start:\n{log.read_text()}"
            time.sleep(0.2)

    def start(self) -> None:
        (self.workdir / "home").mkdir()
        token = self.ray("get-auth-token", "--generate")
        assert token.returncode == 0, token.stderr
        self.start_node(
            "head", "--head", f"--port={self.port}", "--num-cpus=1", '--resources={"head":1}',
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
        )
        self.start_node(
            "worker", f"--address=127.0.0.1:{self.port}", "--num-cpus=2", '--resources={"worker":1}',
            f"--dashboard-agent-listen-port={free_port()}",
        )

    def node_resources(self) -> dict[str, dict]:
        """Every node's id and resources, from the cluster's state API."""
        listed = self.ray("list", "nodes", "--address", self.dashboard, "--format", "json", "--detail")
        assert listed.returncode == 0, listed.stderr
        return {n["node_id"]: n["resources_total"] for n in json.loads(listed.stdout)}

    def stop(self) -> None:
        for proc in reversed(self.nodes):
            stop_tree(proc)


@pytest.fixture
def cluster(tmp_path):
    temp_dir = Path(tempfile.mkdtemp(prefix="rfedray-ray-", dir="/tmp"))
    loopback = LoopbackCluster(tmp_path, temp_dir)
    try:
        loopback.start()
        yield loopback
    finally:
        loopback.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submission_spreads_the_clients_over_both_nodes(cluster, tmp_path):
    runs = tmp_path / "runs"
    command = ["rfedray", "run", "configs/fedpca.yaml", *RUN, f"run.output_dir={runs}"]
    job = cluster.ray("job", "submit", "--address", cluster.dashboard, "--", *command, timeout=300)
    output = job.stdout + job.stderr
    print(output)
    assert job.returncode == 0 and re.search(r"Job 'raysubmit_\w+' succeeded", output), output
    assert "Traceback" not in output
    (run_dir,) = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    expected = load_config(ROOT / "configs/fedpca.yaml", RUN).run.rounds
    assert summary["rounds_completed"] == expected == 3 and summary["engine"] == "ray"
    assert f"done: {expected} rounds" in output
    nodes = cluster.node_resources()
    (head,) = [node for node, resources in nodes.items() if "head" in resources]
    (worker,) = [node for node, resources in nodes.items() if "worker" in resources]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["server"]["node_id"] == head
    assert sorted(a["node_id"] for a in placement["client_actors"]) == sorted([head, worker])
