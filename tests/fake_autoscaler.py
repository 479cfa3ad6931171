"""Ray's own fake autoscaling cluster on this machine, for tests.

Ray's autoscaler tests use the ``fake_multinode`` node provider: the head's autoscaler "launches" a
worker node by starting Ray node processes on this machine with the resources its node type
declares (a ``GPU`` there is a number for the scheduler; no device exists). This module starts such
a head with ``ray start --head --autoscaling-config=...`` and the environment Ray's
``AutoscalingCluster`` sets (``RAY_FAKE_CLUSTER=1``, a one-second autoscaler loop), on free ports,
with its own HOME and temporary directory, and stops it by signalling its process tree: the worker
nodes the autoscaler started are children of its monitor. (``ray.cluster_utils.AutoscalingCluster``
itself runs ``ray stop --force``, which would stop every other Ray instance of a shared machine, and
reads an ``example.yaml`` that the ray wheel does not ship.)

Use::

    with FakeAutoscalingCluster(workdir, {"gpu_worker": {"resources": {"CPU": 1, "GPU": 1},
                                          "min_workers": 0, "max_workers": 2}}) as cluster:
        ... rfedray run ... ray.address={cluster.address} (env=cluster.env)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional

from prometheus_server import free_port
from test_job_submit import stop_tree

BIN = Path(sys.executable).parent
HEAD_NODE_TYPE = "ray.head.default"
START_TIMEOUT_S = 180


class FakeAutoscalingCluster:
    """A head node (no CPU, no GPU) whose autoscaler adds ``fake_multinode`` workers on demand.

    Parameters
    ----------
    workdir : Path
        Holds HOME, the autoscaling configuration and the head's log.
    worker_types : mapping
        ``available_node_types`` entries of the worker types (``resources``, ``min_workers``,
        ``max_workers``; ``node_config`` is filled in).
    max_workers : int
        The cluster's cap on worker nodes.
    idle_timeout_minutes : float
        How long an idle worker stays before the autoscaler removes it.
    """

    def __init__(self, workdir: Path, worker_types: Mapping[str, dict], *, max_workers: int = 4,
                 idle_timeout_minutes: float = 5.0):
        self.workdir = Path(workdir)
        self.worker_types = {name: {"node_config": {}, **spec} for name, spec in worker_types.items()}
        self.max_workers, self.idle_timeout_minutes = max_workers, idle_timeout_minutes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir: Optional[Path] = None
        self.head: Optional[subprocess.Popen] = None
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(HOME=str(self.workdir / "home"), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")

    def config(self) -> dict:
        """The autoscaling configuration (the ``ray up`` format, with the fake provider)."""
        return {
            "cluster_name": "rfedray-fake",
            "max_workers": self.max_workers,
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "provider": {
                "type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                "disable_launch_config_check": True, "gcs_address": self.address,
            },
            "available_node_types": {
                HEAD_NODE_TYPE: {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
                **self.worker_types,
            },
            "head_node_type": HEAD_NODE_TYPE,
            "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }

    @property
    def log(self) -> Path:
        return self.workdir / "head.log"

    def start(self) -> "FakeAutoscalingCluster":
        (self.workdir / "home").mkdir(parents=True, exist_ok=True)
        config = self.workdir / "autoscaling.json"
        config.write_text(json.dumps(self.config()))
        # Short: Ray's socket paths must stay under 108 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rfedray-fake-", dir="/tmp"))
        env = dict(self.env, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        with open(self.log, "w") as out:
            self.head = subprocess.Popen(
                [str(BIN / "ray"), "start", "--head", f"--port={self.port}", "--num-cpus=0", "--num-gpus=0",
                 f"--autoscaling-config={config}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
                 f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
                 "--disable-usage-stats", "--block"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in self.log.read_text():
            if self.head.poll() is not None or time.monotonic() > deadline:
                text = self.log.read_text()
                self.stop()
                raise RuntimeError(f"the fake autoscaling head did not start:\n{text}")
            time.sleep(0.2)
        return self

    def monitor_log(self) -> str:
        """The autoscaler's log (what it launched, and why not), for failure messages."""
        logs = sorted(self.temp_dir.glob("session_*/logs/monitor.log")) if self.temp_dir else []
        return logs[-1].read_text(errors="replace")[-4000:] if logs else ""

    def stop(self) -> None:
        """Stop the head and every worker node its autoscaler started. Idempotent."""
        if self.head is not None:
            stop_tree(self.head)
            self.head = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def __enter__(self) -> "FakeAutoscalingCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
