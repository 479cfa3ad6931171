"""Issue 18: `rfedray run` grows Ray's own fake autoscaling cluster to GPU workers (slow).

The cluster (``tests/fake_autoscaler.py``): a head with no CPU and no GPU, and one worker type that
declares 1 CPU and 1 GPU, at most 2 nodes, none at the start. A run whose four client actors each
ask for half a GPU (``ray.num_gpus_per_actor=0.5``, training on the CPU: ``ray.device=cpu``) makes
the autoscaler add two fake GPU workers; the actors land on them, ``placement.json`` shows their
nodes and GPU ids, and the run ends with the same model as the local engine for the same seed. A
request that no node type can satisfy is refused at once with one line naming the field.

Run: ``.venv/bin/python -m pytest -m slow tests/test_autoscaling.py`` (about 2 minutes alone on 2 cores).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from fake_autoscaler import FakeAutoscalingCluster
from rfedray.federated.loop import run_federation
from rfedray.federated.rundir import RunDirectory
from test_ray_engine import SMALL, small_cfg

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GPU_WORKER = {"resources": {"CPU": 1, "GPU": 1}, "min_workers": 0, "max_workers": 2}
RUN = [*SMALL, "run.rounds=4", "federation.n_clients=8", "federation.clients_per_round=4"]
ACTORS = ["ray.num_client_actors=4", "ray.num_cpus_per_actor=0.5", "ray.num_gpus_per_actor=0.5", "ray.device=cpu"]


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    with FakeAutoscalingCluster(tmp_path_factory.mktemp("fake-autoscaler"), {"gpu_worker": GPU_WORKER},
                                max_workers=2) as cluster:
        yield cluster


def rfedray_run(cluster, out, *overrides, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "rfedray.cli", "run", *RUN, f"run.output_dir={out}", "run.engine=ray",
         f"ray.address={cluster.address}", *overrides, "--quiet"],
        cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=timeout,
    )


def nodes(cluster) -> list[dict]:
    """Every node the cluster has had: id, resources, alive."""
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        return [{"id": n["NodeID"], "resources": n["Resources"], "alive": n["Alive"]} for n in ray.nodes()]
    finally:
        ray.shutdown()


def test_a_request_no_node_type_can_host_is_refused_at_once(fake_cluster, tmp_path):
    started = time.monotonic()
    out = rfedray_run(fake_cluster, tmp_path, *ACTORS[:-2], "ray.num_gpus_per_actor=2", "ray.device=cpu",
                      "ray.actor_start_timeout_s=900")
    elapsed = time.monotonic() - started
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ray.num_gpus_per_actor=2.0: no node type of the Ray cluster has 2 GPU for one "
                           "client actor (the largest has 1;"), last
    assert "worker node types gpu_worker {CPU: 1, GPU: 1} x 2" in last
    assert "Traceback" not in out.stderr and elapsed < 300  # refused, not waited for (900 s)
    assert not any(n["resources"].get("GPU") for n in nodes(fake_cluster)), "no GPU node was started for it"


def test_the_run_grows_the_cluster_to_gpu_workers_and_matches_the_local_engine(fake_cluster, tmp_path):
    before = nodes(fake_cluster)
    assert len(before) == 1 and "GPU" not in before[0]["resources"], before  # the head alone, no GPU

    out = rfedray_run(fake_cluster, tmp_path / "ray", *ACTORS)
    assert out.returncode == 0, out.stderr + fake_cluster.monitor_log()
    run_dir = Path(out.stdout.strip().splitlines()[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "ray" and summary["rounds_completed"] == 4 and summary["client_failures"] == 0

    gpu_nodes = {n["id"] for n in nodes(fake_cluster) if n["resources"].get("GPU", 0) >= 1}
    placement = json.loads((run_dir / "placement.json").read_text())
    actors = placement["client_actors"]
    assert len(actors) == 4
    assert {a["node_id"] for a in actors} == gpu_nodes and len(gpu_nodes) == 2  # two workers were added
    assert placement["server"]["node_id"] not in gpu_nodes  # the server stays on the head
    for a in actors:
        assert a["device"] == "cpu" and len(a["gpu_ids"]) == 1, a  # half a GPU each, two per node
    assert sorted(c for a in actors for c in a["clients"]) == list(range(8))

    local_dir = RunDirectory.create(str(tmp_path / "local"), "local")
    local = run_federation(small_cfg(tmp_path / "local", *RUN[len(SMALL):], "run.engine=local"), local_dir)
    theta_ray, theta_local = torch.load(run_dir / "model_final.pt"), torch.load(local_dir.final_model)
    assert all(torch.equal(theta_ray[k], theta_local[k]) for k in theta_local)
    assert summary["epsilon_spent"] == local["epsilon_spent"]
