"""deploy/: `ray up` configurations, KubeRay manifests, the Dockerfile and the README's commands.

Offline checks: Ray's own validator (``prepare_config`` + ``validate_config``, i.e. the JSON schema
shipped in the ray package) accepts the cluster configurations and rejects broken ones; the
KubeRay manifests use KubeRay's field names; the Compute Engine node configurations have the API's
types; every file, console script, configuration key and ``ray`` command line they or the README
reference exists; nothing is open to the world; the GPU job fits the clusters' node types.
"""

from __future__ import annotations

import copy
import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import jsonschema
import pytest
import yaml

from actors.cluster import HEAD_RESOURCE, ClusterShape, NodeType
from rfedray import config as rfedray_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLUSTER_CONFIGS = [DEPLOY / "aws.yaml", DEPLOY / "gcp.yaml"]
RAYJOB = DEPLOY / "kuberay" / "rayjob.yaml"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
README = DEPLOY / "README.md"
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"
FORWARDED_PORTS = {8000, 8265, 9090}

# Field names of KubeRay's ray.io/v1 types (ray-operator/apis/ray/v1/*_types.go).
RAYJOB_SPEC_FIELDS = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
    "clusterSelector", "submitterConfig", "managedBy", "deletionPolicy", "deletionStrategy", "entrypoint",
    "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
    "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend",
}
RAYCLUSTER_SPEC_FIELDS = {
    "suspend", "managedBy", "autoscalerOptions", "headServiceAnnotations", "enableInTreeAutoscaling",
    "gcsFaultToleranceOptions", "headGroupSpec", "rayVersion", "workerGroupSpecs", "authOptions",
}
HEAD_GROUP_FIELDS = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
WORKER_GROUP_FIELDS = {
    "suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
    "rayStartParams", "template", "scaleStrategy", "numOfHosts",
}
AUTH_OPTIONS_FIELDS = {"mode", "secretName", "enableK8sTokenAuth"}


def load(path: Path):
    return yaml.safe_load(path.read_text())


def constraint(name: str) -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.lower().startswith(f"{name.lower()}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not pinned in constraints.txt")


def prepared(config: dict) -> dict:
    """Ray's validator on the file as written, then what `ray up` does offline before it contacts
    the cloud: fill in the provider's defaults and validate the result."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    logging.getLogger("ray").setLevel(logging.ERROR)
    validate_config(config)
    full = prepare_config(copy.deepcopy(config))
    validate_config(full)
    return full


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_ray_accepts_the_cluster_config(path):
    config = prepared(load(path))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    # The head hosts no client actor: no CPU and no GPU for Ray's scheduler.
    assert head["resources"].get("CPU") == 0 and "GPU" not in head["resources"] and head["max_workers"] == 0
    assert "--num-cpus=0" in " ".join(config["head_start_ray_commands"])
    assert len(workers) == 1
    (gpu,) = workers
    assert gpu["resources"]["GPU"] >= 1
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= config["max_workers"]


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda c: c.update(max_worker=c.pop("max_workers")), jsonschema.ValidationError),
        (lambda c: c.update(max_workers="four"), jsonschema.ValidationError),
        (lambda c: c["available_node_types"]["worker_gpu"].update(
            min_worker=c["available_node_types"]["worker_gpu"].pop("min_workers")), jsonschema.ValidationError),
        (lambda c: c["available_node_types"]["worker_gpu"]["resources"].update(GPU="1"), jsonschema.ValidationError),
        (lambda c: c.update(file_mounts=["./rfedray"]), jsonschema.ValidationError),
        (lambda c: c.update(idle_timeout_minutes="ten"), jsonschema.ValidationError),
        (lambda c: c.update(head_node_type="head"), ValueError),
    ],
    ids=["typo-top-level-key", "wrong-type-max-workers", "typo-node-type-key", "wrong-type-resource",
         "mounts-not-a-mapping", "wrong-type-timeout", "unknown-head-type"],
)
def test_ray_rejects_a_broken_cluster_config(path, breakage, expected):
    config = load(path)
    breakage(config)
    with pytest.raises(expected):
        prepared(config)


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_nodes_run_the_pinned_environment_of_the_image(path):
    config = load(path)
    assert config["docker"]["image"] == "REGISTRY/rfedray:0.1.0" and config["docker"]["container_name"]
    assert "export RAY_AUTH_MODE=token" in "\n".join(config["setup_commands"])
    assert "rfedray --help" in "\n".join(config["setup_commands"])
    # Every command Ray runs on a node is valid bash.
    for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):
        for command in config[key]:
            result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
            assert result.returncode == 0, (key, command, result.stderr)
    # Paths inside the image exist in the repository it is built from.
    for command in config["head_setup_commands"] + config["head_start_ray_commands"]:
        for inside in re.findall(r"/opt/rfedray/(\S+)", command):
            assert (ROOT / inside).exists(), inside


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_ray_starts_with_metrics_and_reachable_dashboard(path):
    config = load(path)
    head = " ".join(config["head_start_ray_commands"])
    assert "ray start --head" in head
    assert "--metrics-export-port=8080" in head and "--dashboard-host=0.0.0.0" in head
    assert "--metrics-export-port=8080" in " ".join(config["worker_start_ray_commands"])


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_file_mounts_carry_the_token_only(path):
    assert load(path)["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_the_head_runs_prometheus_on_the_repositorys_configuration(path):
    start = " ".join(load(path)["head_start_ray_commands"])
    assert "prometheus --config.file=/opt/rfedray/monitoring/prometheus.yml" in start
    assert "--web.listen-address=127.0.0.1:9090" in start  # reached through a port forward only


def test_aws_opens_nothing_to_the_world():
    group = load(DEPLOY / "aws.yaml")["provider"]["security_group"]
    assert group == {"GroupName": "rfedray-ray-cluster"}  # Ray adds SSH and the cluster's own traffic
    assert "0.0.0.0/0" not in (DEPLOY / "aws.yaml").read_text()
    readme = README.read_text()
    assert "CidrIp" not in readme and "firewall-rules create" not in readme


def test_the_readme_forwards_the_ports_over_ssh():
    attaches = [w for w in _readme_commands("ray") if w[1] == "attach"]
    forwarded = {int(w[i + 1]) for w in attaches for i, a in enumerate(w) if a in ("-p", "--port-forward")}
    assert {8000, 9090} <= forwarded
    assert any(w[1] == "dashboard" for w in _readme_commands("ray"))  # 8265
    kubectl = " ".join(" ".join(w) for w in _readme_commands("kubectl"))
    assert "port-forward" in kubectl and "8265:8265" in kubectl and "8000:8000" in kubectl


# The types of the Compute Engine API's Instance fields that deploy/gcp.yaml sets (instances.insert).
GCE_FIELD_TYPES = {
    "machineType": str, "guestAccelerators": list, "metadata": dict, "scheduling": dict, "disks": list,
    "tags": dict, "serviceAccounts": list, "labels": dict, "networkInterfaces": list,
}


def test_gcp_node_configs_have_the_compute_engine_types():
    """Ray's validator does not look inside node_config; the GCE API takes `scheduling` as an object."""
    config = load(DEPLOY / "gcp.yaml")
    for name, node_type in config["available_node_types"].items():
        for field, value in node_type["node_config"].items():
            assert field in GCE_FIELD_TYPES, (name, field)
            assert isinstance(value, GCE_FIELD_TYPES[field]), (name, field, type(value).__name__)
    gpu = config["available_node_types"]["worker_gpu"]["node_config"]
    assert gpu["scheduling"] == {"onHostMaintenance": "TERMINATE"}
    assert gpu["guestAccelerators"][0]["acceleratorCount"] == 1


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _check_cluster_spec(spec: dict, where: str) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC_FIELDS, (where, set(spec) - RAYCLUSTER_SPEC_FIELDS)
    assert spec["rayVersion"] == constraint("ray")
    assert set(spec["authOptions"]) <= AUTH_OPTIONS_FIELDS and spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP_FIELDS, (where, set(head) - HEAD_GROUP_FIELDS)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams values are strings"
    assert head["rayStartParams"]["num-cpus"] == "0", "the head must host no client actor"
    (head_container,) = _containers(head)
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    ports = {p["containerPort"]: p["name"] for p in head_container["ports"]}
    assert ports[8265] == "dashboard" and ports[8000] == "rfedray-metrics" and ports[6379] == "gcs-server"
    assert spec["workerGroupSpecs"], where
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP_FIELDS, (where, set(group) - WORKER_GROUP_FIELDS)
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (worker,) = _containers(group)
        assert {p["containerPort"]: p["name"] for p in worker["ports"]}[8080] == "metrics"
        limits = worker["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
    images = {c["image"] for c in [head_container, *(c for g in spec["workerGroupSpecs"] for c in _containers(g))]}
    workdirs = {c["workingDir"] for c in [head_container, *(c for g in spec["workerGroupSpecs"] for c in _containers(g))]}
    assert len(images) == 1 and workdirs == {_dockerfile_workdir()}


def test_rayjob_manifest_has_kuberay_fields():
    job = load(RAYJOB)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC_FIELDS, set(spec) - RAYJOB_SPEC_FIELDS
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    _check_cluster_spec(spec["rayClusterSpec"], "RayJob.spec.rayClusterSpec")


def test_raycluster_manifest_has_kuberay_fields():
    cluster = load(RAYCLUSTER)
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert cluster["metadata"]["name"] == "rfedray"
    _check_cluster_spec(cluster["spec"], "RayCluster.spec")
    job_cluster = load(RAYJOB)["spec"]["rayClusterSpec"]
    assert cluster["spec"] == job_cluster, "the RayJob's cluster and the RayCluster should be the same cluster"


def _rfedray_command(entrypoint: str) -> list[str]:
    words = shlex.split(entrypoint)
    assert words[:2] == ["rfedray", "run"], entrypoint
    return words


def test_rayjob_entrypoint_uses_the_console_script_and_valid_config_keys():
    words = _rfedray_command(load(RAYJOB)["spec"]["entrypoint"])
    scripts = load_toml(ROOT / "pyproject.toml")["project"]["scripts"]
    assert scripts["rfedray"] == "rfedray.cli:main"
    assert not any(ch in " ".join(words) for ch in "&|;`"), "KubeRay passes the entrypoint to a shell as is"
    overrides = words[3:]
    keys = set(rfedray_config._all_keys(rfedray_config.Config))
    for item in overrides:
        key, _, _ = item.partition("=")
        assert key in keys, f"entrypoint override {item!r}: not a configuration key"


def test_rayjob_entrypoint_config_file_exists_and_loads():
    words = _rfedray_command(load(RAYJOB)["spec"]["entrypoint"])
    path = ROOT / words[2]
    assert path.is_file(), f"{words[2]} (run by deploy/kuberay/rayjob.yaml and deploy/README.md) does not exist"
    cfg = rfedray_config.load_config(path, words[3:])
    assert cfg.run.engine == "ray" and cfg.monitoring.metrics_port == 8000 and cfg.monitoring.metrics_host == "0.0.0.0"
    # The GPU job: several client actors share each GPU, and the worker group can grow to host them.
    assert 0 < cfg.ray.num_gpus_per_actor < 1 and cfg.model.name == "spdnet" and cfg.data.source == "moabb"
    spec = load(RAYJOB)["spec"]["rayClusterSpec"]
    types = []
    for group in spec["workerGroupSpecs"]:
        limits = _containers(group)[0]["resources"]["limits"]
        types.append(NodeType(group["groupName"], {"CPU": float(limits["cpu"]), "GPU": float(limits["nvidia.com/gpu"])},
                              group["maxReplicas"]))
    shape = ClusterShape(({HEAD_RESOURCE: 1.0, "CPU": 0.0},), autoscaling=True, node_types=tuple(types))
    shape.check(cfg, cfg.ray.num_client_actors)


def load_toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


def _dockerfile_instructions() -> list[tuple[str, str]]:
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            logical.append((keyword.upper(), rest.strip()))
            current = ""
    return logical


def _dockerfile_workdir() -> str:
    (workdir,) = [rest for keyword, rest in _dockerfile_instructions() if keyword == "WORKDIR"]
    return workdir


def test_dockerfile_installs_the_pinned_environment():
    instructions = _dockerfile_instructions()
    assert instructions[0][0] == "FROM" and instructions[0][1].startswith("nvidia/cuda:")
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    joined = "\n".join(runs)
    assert f"{PYTHON} -m venv /opt/rfedray-venv" in joined
    assert """pip install -c constraints.txt -c constraints-cuda.txt "torch==$(grep '^torch==' constraints.txt | cut -d= -f3)\"""" in joined
    assert "pip install -c constraints.txt -c constraints-cuda.txt -e ." in joined
    for command in runs:
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)
    for keyword, rest in instructions:
        if keyword == "COPY":
            *sources, _ = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), f"Dockerfile COPY {src}: not in the repository"


def _readme_commands(prefix: str, section: str = "") -> list[list[str]]:
    """Command lines of the README's bash blocks that start with ``prefix``, continuations joined
    (only those under the ``## `` heading that starts with ``section``, when given)."""
    text = README.read_text()
    if section:
        parts = re.split(r"^## ", text, flags=re.M)
        text = "\n".join(p for p in parts if p.startswith(section))
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip().rstrip("&").strip()
            if line.startswith(prefix + " "):
                commands.append(shlex.split(line))
    return commands


def test_readme_ray_commands_parse_with_rays_cli():
    from ray.scripts.scripts import cli

    commands = _readme_commands("ray")
    used = {" ".join(words[1:3]) for words in commands}
    for needed in ("get-auth-token --generate", "up -y", "job submit", "down -y"):
        assert any(u.startswith(needed) for u in used), needed
    for words in commands:
        command, name, args, ctx = cli, "ray", words[1:], None
        while isinstance(command, click.Group):
            ctx = click.Context(command, info_name=name, parent=ctx)
            name, command, args = command.resolve_command(ctx, args)
        command.make_context(name, list(args), parent=ctx)  # raises click.UsageError for a bad option
        for arg in words:
            if arg.startswith("deploy/"):
                assert (ROOT / arg).exists(), arg


def test_readme_submits_the_same_run_as_the_rayjob():
    """On the cloud clusters, the GPU job of the RayJob (on `ray up` clusters with the bucket of the
    cluster configuration as run.output_dir); on one machine (no GPU), the default job."""
    entrypoint = shlex.split(load(RAYJOB)["spec"]["entrypoint"])
    submits = [w for section in ("VMs", "Kubernetes") for w in _readme_commands("ray", section)
               if w[1:3] == ["job", "submit"] and "--resume" not in " ".join(w)]
    assert len(submits) == 2
    for words in submits:
        command = words[words.index("--") + 1:]
        if command[:2] == ["bash", "-c"]:
            cd, _, rest = command[2].partition(" && ")
            assert cd == f"cd {_dockerfile_workdir()}"
            command = [w if w != "run.output_dir=$RFEDRAY_RUNS" else "run.output_dir=file:///mnt/rfedray-runs"
                       for w in shlex.split(rest)]
        assert command == entrypoint, words
    (local,) = [w for w in _readme_commands("ray", "Try it") if w[1:3] == ["job", "submit"]]
    assert local[local.index("--") + 1:][:3] == ["rfedray", "run", "configs/fedpca.yaml"]
    readme = README.read_text()
    for phrase in ("RAY_AUTH_MODE=token", "~/.ray/auth_token", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        assert phrase in readme, phrase


# Field names of the Prometheus Operator's PodMonitor (monitoring.coreos.com/v1, podmonitor_types.go).
PODMONITOR_SPEC_FIELDS = {
    "jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "namespaceSelector", "sampleLimit",
    "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit", "attachMetadata",
}
POD_ENDPOINT_FIELDS = {
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "relabelings", "metricRelabelings", "enableHttp2", "filterRunning", "followRedirects",
}


def test_the_podmonitor_scrapes_every_ray_pod_and_the_run():
    monitor = load(DEPLOY / "kuberay" / "podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    spec = monitor["spec"]
    assert set(spec) <= PODMONITOR_SPEC_FIELDS, set(spec) - PODMONITOR_SPEC_FIELDS
    selected = spec["selector"]["matchLabels"]
    for path in (RAYJOB, RAYCLUSTER):
        doc = load(path)
        cluster = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for group in groups:  # every Ray pod is selected
            assert selected.items() <= group["template"]["metadata"]["labels"].items(), path.name
        named = {p["name"] for g in groups for c in _containers(g) for p in c.get("ports", [])}
        ports = [endpoint["port"] for endpoint in spec["podMetricsEndpoints"]]
        assert set(ports) == {"metrics", "rfedray-metrics"} and set(ports) <= named
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= POD_ENDPOINT_FIELDS, set(endpoint) - POD_ENDPOINT_FIELDS


# ----- data folders and run storage on every node (issue 18 item 7) ------------------------------

DATA_ENV = ("MNE_DATA", "MNE_DATASETS_EEGBCI_PATH", "RFEDRAY_CACHE_DIR")
"""MNE's and MOABB's data folders and rfedray's cache: set on every node, to the image's folders."""
RUN_STORAGE = {"aws.yaml": "s3://", "gcp.yaml": "gs://"}
CREDENTIAL_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
                    "private_key", "aws_secret_access_key")


def _dockerfile_env() -> dict[str, str]:
    env = {}
    for keyword, rest in _dockerfile_instructions():
        if keyword == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
    return env


def _docker_run(config: dict, node_type: str) -> tuple[dict[str, str], dict[str, str]]:
    """The environment and the volumes (container path: host path) of ``node_type``'s container, read
    from the ``docker run`` command Ray's own command builder makes for it (as ``ray up`` and the
    autoscaler do: the docker block, the node type's docker overrides, run_options plus the head's
    or workers' options)."""
    from ray.autoscaler._private.docker import docker_start_cmds

    docker = {**config["docker"], **config["available_node_types"][node_type].get("docker", {})}
    role = "head" if node_type == config["head_node_type"] else "worker"
    options = docker.get("run_options", []) + docker.get(f"{role}_run_options", [])
    command = docker_start_cmds("ubuntu", docker["image"], {}, docker["container_name"], options,
                                config["cluster_name"], "/root", "docker")
    words = shlex.split(command)
    env, volumes = {}, {}
    for flag, value in zip(words, words[1:]):
        if flag in ("-e", "--env"):
            key, _, val = value.partition("=")
            env[key] = val
        elif flag in ("-v", "--volume"):
            host, _, inside = value.partition(":")
            volumes[inside.split(":")[0]] = host
    return env, volumes


def _under(path: str, folders) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_every_node_type_has_the_data_folders_on_the_hosts_disk_and_names_the_run_storage(path):
    config = prepared(load(path))  # what `ray up` runs with, after Ray's validation and defaults
    image_env = _dockerfile_env()
    for node_type in config["available_node_types"]:
        env, volumes = _docker_run(config, node_type)
        for name in DATA_ENV:
            assert env.get(name) == image_env[name], (node_type, name, env.get(name))
            # On a volume of the host: kept when the container is replaced (no download per restart).
            assert _under(env[name], volumes), (node_type, name, volumes)
        # The run directories: the bucket the README's submit command passes as run.output_dir.
        assert env.get("RFEDRAY_RUNS", "").startswith(RUN_STORAGE[path.name]), (node_type, env)
        assert "BUCKET" in env["RFEDRAY_RUNS"]  # the placeholder deploy/README.md's step 1 replaces
    text = path.read_text()
    assert not any(name in text.replace("# ", "") for name in CREDENTIAL_NAMES), "no keys in a cluster configuration"


def test_gcp_head_can_write_gs_run_directories():
    """gs:// needs gcsfs, which the image lacks: installed (pinned) on the head, where the driver runs."""
    commands = " ".join(load(DEPLOY / "gcp.yaml")["head_setup_commands"])
    pins = dict(re.findall(r"\b([A-Za-z0-9_.-]+)==(\S+)", commands))
    assert "gcsfs" in pins and "-c /opt/rfedray/constraints.txt" in commands
    # gcsfs is released with fsspec: its version is the pinned fsspec's or newer.
    assert tuple(int(v) for v in pins["gcsfs"].split(".")[:2]) >= tuple(int(v) for v in constraint("fsspec").split(".")[:2])
    for name in pins:  # nothing that constraints.txt pins is pinned again here (they could disagree)
        with pytest.raises(AssertionError):
            constraint(name)


def _kuberay_clusters():
    job = load(RAYJOB)
    return [("RayCluster", load(RAYCLUSTER)["spec"]), ("RayJob", job["spec"]["rayClusterSpec"])]


def test_kuberay_every_pod_has_the_data_folders_and_the_head_mounts_the_run_storage():
    image_env = _dockerfile_env()
    claim = load(DEPLOY / "kuberay" / "storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    output_dir = next(w.split("=", 1)[1] for w in _rfedray_command(load(RAYJOB)["spec"]["entrypoint"])
                      if w.startswith("run.output_dir="))
    assert output_dir.startswith("file:///")
    for kind, spec in _kuberay_clusters():
        groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
        for name, group in groups:
            pod = group["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for container in pod["containers"]:
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
                assert set(mounts.values()) <= set(volumes), (kind, name)
                for var in DATA_ENV:
                    assert env.get(var) == image_env[var], (kind, name, var)
                    assert _under(env[var], mounts), (kind, name, var, mounts)
            if name == "head":
                (container,) = pod["containers"]
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                runs = output_dir[len("file://"):]
                volume = volumes[next(n for p, n in mounts.items() if _under(runs, [p]))]
                assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], (kind, volume)


def test_the_readme_runs_name_run_storage_off_the_head():
    """Every `rfedray run` the README submits to a cluster writes its run directory to storage that
    outlives the head: the bucket of the cluster configuration, or the KubeRay shared volume."""
    submits = [w for section in ("VMs", "Kubernetes") for w in _readme_commands("ray", section) if w[1:3] == ["job", "submit"]]
    assert submits
    for words in submits:
        command = words[words.index("--") + 1:]
        if command[:2] == ["bash", "-c"]:
            command = shlex.split(command[2].partition(" && ")[2])
        outputs = [w.split("=", 1)[1] for w in command if w.startswith("run.output_dir=")]
        assert outputs in (["$RFEDRAY_RUNS"], ["file:///mnt/rfedray-runs"]), words
    examples = [w for w in _readme_commands("rfedray") if w[1] == "run" and "--resume" not in w]
    assert examples and all(any(re.match(r"run\.output_dir=(s3|gs|file)://", a) for a in w) for w in examples), examples
