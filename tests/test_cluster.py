"""What a cluster can host for the client actors, waiting for it to grow, and GPUs torch cannot use.

Fixed clusters refuse at once what their live nodes cannot pack (naming the field); autoscaling
clusters refuse only what no node type could ever host, and otherwise wait up to
``ray.actor_start_timeout_s`` with progress lines. The end-to-end run on Ray's fake autoscaling
cluster is ``tests/test_autoscaling.py`` (slow).
"""

import logging
from pathlib import Path

import pytest
import ray
import torch
import yaml

import actors.cluster as cluster
from actors.cluster import HEAD_RESOURCE, ClusterShape, NodeType, node_types_from_config
from rfedray.config import ConfigError, load_config
from rfedray.errors import RfedrayError
from test_ray_engine import run_engine, start_test_ray

ROOT = Path(__file__).resolve().parents[1]
HEAD = {HEAD_RESOURCE: 1.0, "CPU": 2.0}


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_a_fixed_cluster_refuses_what_its_nodes_cannot_pack():
    two_small = ClusterShape.fixed([{"CPU": 1.0}, {"CPU": 1.0}])
    # 2 CPUs in all, but no node holds an actor of 2 CPUs: a per-node check, not a total.
    with pytest.raises(ConfigError, match=r"^ray.num_cpus_per_actor=2\.0: no node of the Ray cluster has 2 CPU"):
        two_small.check(cfg("ray.num_cpus_per_actor=2"), 1)
    with pytest.raises(ConfigError, match="ray.num_gpus_per_actor=0.25: no node of the Ray cluster has 0.25 GPU"):
        ClusterShape.fixed([{"CPU": 2.0}]).check(cfg("ray.num_gpus_per_actor=0.25"), 2)
    with pytest.raises(ConfigError, match=r"ray.num_cpus_per_actor=1\.5: 2 client actors .* has room for at most 1"):
        ClusterShape.fixed([{"CPU": 2.0}]).check(cfg("ray.num_cpus_per_actor=1.5"), 2)
    one_gpu = ClusterShape.fixed([{"CPU": 16.0, "GPU": 1.0}])
    one_gpu.check(cfg("ray.num_gpus_per_actor=0.125"), 8)  # 8 actors share the GPU
    with pytest.raises(ConfigError, match="ray.num_gpus_per_actor=0.125: 9 client actors"):
        one_gpu.check(cfg("ray.num_gpus_per_actor=0.125"), 9)
    # Placement strategies: STRICT_SPREAD needs a node per actor, STRICT_PACK one node for all.
    two_small.check(cfg("ray.placement=STRICT_SPREAD"), 2)
    with pytest.raises(ConfigError, match="STRICT_SPREAD"):
        two_small.check(cfg("ray.placement=STRICT_SPREAD", "ray.num_cpus_per_actor=0.5"), 3)
    with pytest.raises(ConfigError, match="STRICT_PACK"):
        two_small.check(cfg("ray.placement=STRICT_PACK"), 2)
    # Actors that ask for nothing fit anywhere.
    two_small.check(cfg("ray.num_cpus_per_actor=0"), 50)


def test_an_autoscaling_cluster_refuses_only_what_no_node_type_could_host():
    gpu = NodeType("gpu", {"CPU": 4.0, "GPU": 1.0}, 2)
    shape = ClusterShape((HEAD,), autoscaling=True, node_types=(gpu,), max_workers=2)
    # No GPU is up, but two GPU nodes can come: 8 actors of a quarter GPU and one CPU fit.
    shape.check(cfg("ray.num_gpus_per_actor=0.25"), 8)
    assert shape.most_bundles({"CPU": 1.0, "GPU": 0.25}) == 8
    with pytest.raises(ConfigError, match=r"ray.num_gpus_per_actor=2\.0: no node type of the Ray cluster has 2 GPU"):
        shape.check(cfg("ray.num_gpus_per_actor=2"), 1)
    with pytest.raises(ConfigError, match=r"ray.num_gpus_per_actor=0.25: 9 client actors .* could ever host at most 8"):
        shape.check(cfg("ray.num_gpus_per_actor=0.25"), 9)
    # The cluster's worker cap binds before the node type's.
    capped = ClusterShape((HEAD,), autoscaling=True, node_types=(gpu,), max_workers=1)
    assert capped.most_bundles({"CPU": 1.0, "GPU": 0.25}) == 4
    # CPU actors also fit on the head.
    assert shape.most_bundles({"CPU": 1.0}) == 2 + 2 * 4
    # Node types unknown (a KubeRay autoscaler in its own container): only the deadline limits.
    unknown = ClusterShape((HEAD,), autoscaling=True)
    assert unknown.most_bundles({"GPU": 8.0}) is None
    unknown.check(cfg("ray.num_gpus_per_actor=8"), 4)


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_the_cluster_configs_can_grow_to_the_gpu_example(name):
    """The node types of the shipped `ray up` configurations host the GPU example job, from a head
    that hosts no client actor (0 CPUs)."""
    config = yaml.safe_load((ROOT / "deploy" / name).read_text())
    types, cap = node_types_from_config(config)
    head_resources = config["available_node_types"][config["head_node_type"]]["resources"]
    assert head_resources.get("CPU", 0) == 0 and head_resources.get("GPU", 0) == 0
    shape = ClusterShape(({HEAD_RESOURCE: 1.0, **head_resources},), autoscaling=True, node_types=types, max_workers=cap)
    example = load_config(ROOT / "configs" / "eeg_physionet_spdnet_gpu.yaml")
    shape.check(example, example.ray.num_client_actors)
    bundle = cluster.actor_bundle(example)
    assert 0 < bundle["GPU"] < 1 and shape.most_bundles({"CPU": 1.0, **bundle}) >= example.ray.num_client_actors


@pytest.fixture(scope="module")
def fake_gpu_ray():
    """A local Ray instance whose node advertises one (fake) GPU to the scheduler."""
    start_test_ray(num_gpus=1)
    yield
    ray.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch cannot use CUDA (here it can)")
def test_an_actor_refuses_a_gpu_torch_cannot_use(tmp_path, fake_gpu_ray):
    with pytest.raises(RfedrayError) as info:
        run_engine(tmp_path, "fake-gpu", "ray.num_gpus_per_actor=0.5", "ray.num_client_actors=2", "ray.device=auto",
                   "ray.actor_start_timeout_s=300")
    message = str(info.value)
    assert message.startswith("a client actor failed to start: ray.device=auto: Ray assigned GPU 0 to this client actor")
    assert f"torch {torch.__version__} is a CPU-only build" in message
    assert "no NVIDIA driver is loaded on this node" in message and "ray.device=cpu" in message
    assert "\n" not in message


def test_a_fixed_cluster_refuses_at_once(tmp_path, fake_gpu_ray):
    with pytest.raises(ConfigError, match=r"ray.num_gpus_per_actor=0.5: 3 client actors .* has room for at most 2"):
        run_engine(tmp_path, "too-many", "ray.num_gpus_per_actor=0.5", "ray.num_client_actors=3",
                   "ray.num_cpus_per_actor=0", "ray.device=cpu", "ray.actor_start_timeout_s=60")


def test_waiting_for_the_cluster_says_what_it_waits_for_and_stops_at_the_deadline(
        tmp_path, fake_gpu_ray, monkeypatch, caplog):
    """An autoscaler that never delivers: progress lines, then one error naming the deadline."""
    def never_grows():
        live = tuple(n["Resources"] for n in ray.nodes() if n["Alive"])
        return ClusterShape(live, autoscaling=True, node_types=None, pending=1)

    monkeypatch.setattr(ClusterShape, "discover", staticmethod(never_grows))
    monkeypatch.setattr(cluster, "PROGRESS_INTERVAL_S", 1.0)
    caplog.set_level(logging.WARNING, logger="actors.cluster")
    with pytest.raises(RfedrayError) as info:
        run_engine(tmp_path, "waits", "ray.num_gpus_per_actor=2", "ray.num_client_actors=2", "ray.num_cpus_per_actor=0",
                   "ray.device=cpu", "ray.actor_start_timeout_s=4")
    message = str(info.value)
    assert message.startswith("ray.actor_start_timeout_s=4: 2 of 2 client actors started not ready; waiting for 2 of "
                              "2 client actors' GPU bundles {GPU: 2}: 0 node(s) for them up, 1 starting")
    assert "The cluster: 1 live node(s) {CPU: 2, GPU: 1}" in message and "\n" not in message
    notes = [r.getMessage() for r in caplog.records if r.name == "actors.cluster"]
    assert len(notes) >= 2 and all(n.startswith("waiting for 2 of 2 client actors' GPU bundles") for n in notes)


def test_the_progress_line_names_the_bundles_or_says_the_actors_ask_for_none():
    fixed = ClusterShape.fixed([{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0}])
    gpu = cluster.ClusterWait(cfg("ray.num_gpus_per_actor=0.5", "ray.actor_start_timeout_s=60"), 4, fixed)
    assert gpu.progress(3) == ("waiting for 3 of 4 client actors' GPU bundles {CPU: 1, GPU: 0.5}: 1 node(s) for "
                               "them up (0 s of ray.actor_start_timeout_s=60)")
    fits = cluster.ClusterWait(cfg("ray.num_cpus_per_actor=1", "ray.actor_start_timeout_s=60"), 4, fixed)
    assert fits.progress(4) == ("waiting for 4 of 4 client actors to start: the 2 node(s) up hold their bundles "
                                "{CPU: 1} (0 s of ray.actor_start_timeout_s=60)")
    free = cluster.ClusterWait(cfg("ray.num_cpus_per_actor=0", "ray.actor_start_timeout_s=60"), 2, fixed)
    assert free.progress(2) == ("waiting for 2 of 2 client actors to start: 2 node(s) up "
                                "(0 s of ray.actor_start_timeout_s=60)")
