"""This process's connection to Ray: the cluster given by ``ray.address`` (or ``RAY_ADDRESS``), or a
local instance started for the run and shut down after it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Optional

import ray

from rfedray.config import Config, ConfigError
from rfedray.errors import RfedrayError
from rfedray.plugins import code_locations
from rfedray.progress import log_startup

log = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 200 * 1024**2
"""Object store of a Ray instance the driver starts itself (it holds one theta_t per round)."""

TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""The logger of Ray's "Token authentication is enabled for this Ray cluster" warning."""

LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
"""Ray settings of an instance the driver starts itself: no idle worker started ahead for the driver
(the client actors start their own workers; an idle one held ~80 MiB for the whole run)."""

UNUSED_PROCESSES = ("dashboard", "monitor", "log_monitor")
"""Ray's processes (by Ray's process type) that a local instance the driver starts stops once it is up: the dashboard head
(``include_dashboard=False`` leaves it running usage statistics only: no metrics module, so no
Prometheus service-discovery file on a local instance), the autoscaler monitor (there is no
autoscaler on one machine) and the log monitor (it forwards the workers' output to a driver, and
this one has ``log_to_driver=False``). About 270 MiB together (``benchmarks/procmem.py``);
``ray.init`` has no switch for them. The GCS, the raylet and its agents stay (the dashboard agent
exports the node's Ray metrics on its metrics export port)."""

CONNECT_TIMEOUT_S = 5.0
REAPER_WAIT_S = 5.0
"""How long closing a local Ray instance waits for the reaper (:mod:`actors.reaper`) to finish."""


def _init_ray(**kwargs) -> None:
    """``ray.init(**kwargs)``, keeping this process's SIGTERM handling.

    Ray's core worker installs a SIGTERM handler that aborts the process with a crash dump; the
    driver keeps its own (the CLI's: stop as Ctrl-C does, exit status 143, resumable).
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(**kwargs)
    if main and previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _stop_unused_processes() -> None:
    """Stop the :data:`UNUSED_PROCESSES` of the Ray instance this process started."""
    node = ray._private.worker._global_node
    for process_type in UNUSED_PROCESSES:
        node._kill_process_type(process_type, check_alive=False, wait=True)


def _reachable(host: str, port: int) -> Optional[str]:
    """None if something accepts TCP connections at ``host:port``, else why not."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


class RaySession:
    """This process's connection to Ray; shuts Ray down on :meth:`close` only if it started it.

    Parameters
    ----------
    started : bool
        Whether :meth:`open` started the Ray instance.
    """

    def __init__(self, started: bool, reaper: Optional[subprocess.Popen] = None):
        self.started, self.reaper = started, reaper

    @classmethod
    def open(cls, address: Optional[str]) -> "RaySession":
        """Use the Ray of this process, connect to ``address`` (or ``RAY_ADDRESS``), or start one
        (without its :data:`UNUSED_PROCESSES`).

        Raises
        ------
        RfedrayError
            Naming ``ray.address`` when there is no Ray cluster to connect to.
        """
        if ray.is_initialized():
            return cls(started=False)
        label = "ray.address"
        if address is None and os.environ.get("RAY_ADDRESS"):
            address, label = os.environ["RAY_ADDRESS"], "ray.address (from RAY_ADDRESS)"
        if address is None:
            # The Ray processes this driver starts end with it, even when it is killed.
            reaper = subprocess.Popen([sys.executable, "-m", "actors.reaper", str(os.getpid())], stdin=subprocess.PIPE,
                                      cwd=Path(__file__).resolve().parents[1])
            # Ray turns token authentication on for a new local instance (RAY_AUTH_MODE unset) and warns
            # that it did; rfedray's own instance keeps it on, without the warning. (Setting RAY_AUTH_MODE
            # here instead would not do: Ray read it when it was imported, and a value set now reaches the
            # GCS it starts but not this process, whose requests the GCS then refuses.)
            auth_log = logging.getLogger(TOKEN_AUTH_LOGGER)
            level = auth_log.level
            auth_log.setLevel(logging.ERROR)
            try:
                _init_ray(
                    address="local", include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    log_to_driver=False, logging_level=logging.WARNING, _system_config=LOCAL_SYSTEM_CONFIG,
                )
            except BaseException:
                reaper.stdin.close()
                raise
            finally:
                auth_log.setLevel(level)
            _stop_unused_processes()
            log_startup("Ray started")
            return cls(started=True, reaper=reaper)
        if address.startswith("ray://"):
            raise ConfigError(label, address, "Ray Client addresses are not supported: run rfedray on a node of the "
                              "cluster (ray.address=auto or the head's HOST:PORT)")
        hint = "start a cluster with `ray start --head`, or leave ray.address unset to run a local Ray instance"
        if address != "auto":
            host, _, port = address.rpartition(":")
            problem = _reachable(host.strip("[]"), int(port)) if host and port.isdigit() else "expected auto or HOST:PORT"
            if problem is not None:
                raise RfedrayError(f"{label}={address!r}: no Ray cluster reachable there ({problem}); {hint}")
        try:
            _init_ray(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0]
            raise RfedrayError(f"{label}={address!r}: cannot connect to a Ray cluster ({reason}); {hint}") from None
        return cls(started=False)

    @property
    def one_machine(self) -> bool:
        """Whether the run has this machine to itself: this process started the Ray instance, so every
        process of the run is here (no cluster, no other driver)."""
        return self.started

    def close(self) -> None:
        try:
            if self.started and ray.is_initialized():
                ray.shutdown()
        finally:
            if self.reaper is not None:
                self.reaper.stdin.close()  # the reaper ends whatever Ray left running
                try:
                    self.reaper.wait(timeout=REAPER_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
                self.reaper = None


def check_ray_config(cfg: Config) -> None:
    """Settings the Ray engine needs together (each field alone is checked by the config).

    Raises
    ------
    ConfigError
    """
    if cfg.ray.device == "cuda" and cfg.ray.num_gpus_per_actor <= 0:
        raise ConfigError("ray.device", "cuda", "needs ray.num_gpus_per_actor > 0 (e.g. 0.125 packs 8 actors on a GPU)")


def user_code_env(cfg: Config, objects: Iterable[Any] = ()) -> Optional[dict]:
    """The Ray runtime environment that brings the user's code to every node, or None if none is needed.

    Plugins named by import path (``model.name``, ``data.source``) and the classes of ``objects``
    (the model and dataset given to :func:`rfedray.api.run`) whose modules are not installed in this
    Python environment (a module beside the user's script, a folder on ``PYTHONPATH``) travel as
    ``py_modules``: they are uploaded to the cluster once (Ray's own upload of a job's
    ``py_modules``, since an actor's runtime environment takes package URIs only) and every actor
    that builds the task imports them on its node. Installed packages are expected on every node,
    like rfedray itself. Call it connected to Ray.
    """
    paths = code_locations(cfg.model.name, cfg.data.source, objects)
    if not paths:
        return None
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

    with tempfile.TemporaryDirectory(prefix="rfedray-py-modules-") as scratch:
        return upload_py_modules_if_needed({"py_modules": paths}, include_gitignore=True, scratch_dir=scratch, logger=log)
