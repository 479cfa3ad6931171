"""Memory of a command and of every process it starts (Ray's included), sampled while it runs.

:func:`run_sampled` starts a command in a session of its own (Ray's GCS, raylet, agents and workers
stay in it even when they are re-parented), and every ``interval`` seconds sums the resident set
size (RSS) of the session's processes. It keeps the largest sum and the per-process breakdown at
that moment, each process labelled by its role (:func:`role`): the command itself (``driver``), a
Ray actor by its class (``ray::ServerActor``), an idle Ray worker, or one of Ray's own processes
(``gcs_server``, ``raylet``, ``dashboard``, ``dashboard_agent``, ``runtime_env_agent``,
``monitor``, ``log_monitor``).

Summed RSS counts shared pages (the torch library mapped by several processes) once per process;
that is the measure of both sides of :mod:`side_by_side`. USS (the pages only that process maps) is
reported beside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import psutil

MIB = 2**20

RAY_PROCESSES = {
    "gcs_server": "gcs_server", "raylet": "raylet", "dashboard/agent.py": "dashboard_agent",
    "runtime_env/agent": "runtime_env_agent", "dashboard.py": "dashboard", "log_monitor.py": "log_monitor",
    "monitor.py": "monitor", "ray_process_reaper": "reaper",
}
"""Substring of a command line -> the name of Ray's own process."""


def role(proc: psutil.Process, driver_pid: int) -> str:
    """What ``proc`` is in a run (see the module docstring)."""
    if proc.pid == driver_pid:
        return "driver"
    try:
        cmdline = proc.cmdline()
    except (psutil.Error, OSError):
        return "?"
    if cmdline and cmdline[0].startswith("ray::"):
        name = cmdline[0].split()[0]
        return "ray::IDLE" if name == "ray::IDLE" else name.split(".")[0]
    joined = " ".join(cmdline)
    for needle, name in RAY_PROCESSES.items():
        if needle in joined:
            return name
    if "default_worker.py" in joined:
        return "ray::worker"
    return os.path.basename(cmdline[0]) if cmdline else "?"


@dataclass
class Sample:
    """One moment of a run: per process ``(role, pid, rss, uss)`` in bytes."""

    seconds: float
    processes: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def rss(self) -> int:
        return sum(p[2] for p in self.processes)

    def by_role(self) -> dict[str, dict]:
        """``{role: {"count": c, "rss_mib": r, "uss_mib": u}}``, largest RSS first."""
        roles: dict[str, dict] = {}
        for name, _, rss, uss in self.processes:
            r = roles.setdefault(name, {"count": 0, "rss_mib": 0.0, "uss_mib": 0.0})
            r["count"] += 1
            r["rss_mib"] += rss / MIB
            r["uss_mib"] += uss / MIB
        return dict(sorted(roles.items(), key=lambda kv: -kv[1]["rss_mib"]))


def session_sample(sid: int, t0: float, with_uss: bool) -> Sample:
    """Every live process of session ``sid`` now."""
    sample = Sample(time.perf_counter() - t0)
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) != sid:
                continue
            if with_uss:
                info = proc.memory_full_info()
                rss, uss = info.rss, info.uss
            else:
                rss, uss = proc.memory_info().rss, 0
            sample.processes.append((role(proc, sid), proc.pid, rss, uss))
        except (psutil.Error, OSError):
            continue
    return sample


@dataclass
class Run:
    """A finished command: exit status, wall time, its output and the sample of its peak RSS."""

    returncode: int
    seconds: float
    output: str
    peak: Sample
    events: dict = field(default_factory=dict)


def run_sampled(cmd: Sequence[str], log_path: str, *, cwd: Optional[str] = None, env: Optional[dict] = None,
                interval: float = 0.1, watch: Optional[Callable[[float], None]] = None) -> Run:
    """Run ``cmd`` in a new session, sampling its processes' memory every ``interval`` seconds.

    Parameters
    ----------
    cmd : sequence of str
    log_path : str
        Where its stdout and stderr go.
    cwd, env
        Of the command.
    interval : float
    watch : callable or None
        Called with the seconds since the start after every sample (to note progress).

    Returns
    -------
    Run
        The largest summed RSS and its breakdown (USS included) in ``peak``. Ray processes left
        behind after the command ends get 20 s to exit, then are killed.
    """
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        peak = Sample(0.0)
        while proc.poll() is None:
            sample = session_sample(proc.pid, t0, with_uss=False)
            if sample.rss > peak.rss:
                peak = sample
                detailed = session_sample(proc.pid, t0, with_uss=True)  # USS too, a moment later
                if detailed.rss >= sample.rss:
                    peak = detailed
            if watch is not None:
                watch(time.perf_counter() - t0)
            time.sleep(interval)
    seconds = time.perf_counter() - t0
    deadline = time.time() + 20
    while session_sample(proc.pid, t0, with_uss=False).processes and time.time() < deadline:
        time.sleep(0.2)
    if session_sample(proc.pid, t0, with_uss=False).processes:
        os.killpg(proc.pid, signal.SIGKILL)
    with open(log_path) as f:
        output = f.read()
    return Run(proc.returncode, seconds, output, peak)
