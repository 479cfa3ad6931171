"""Fate-sharing of a local Ray instance with the driver that started it.

``ray.init()`` starts Ray's processes (GCS, raylet, dashboard agent, runtime-env agent, workers)
as descendants of the driver. When the driver is killed (SIGKILL, the OOM killer), the raylet's
agents keep running for a minute or more, waiting on a GCS that is gone. The driver therefore
starts this small watcher first::

    python -m actors.reaper DRIVER_PID        (stdin: a pipe only the driver writes to)

It notes the driver's descendants every :data:`POLL_S` seconds. When the pipe closes (the driver
ended, however it ended), it gives them :data:`GRACE_S` seconds to exit on their own and kills
the ones left (checking each pid's start time, so a reused pid is never touched).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 2.0


def _descendants(driver: psutil.Process) -> dict[int, float]:
    """``{pid: start time}`` of the driver's descendants but this watcher."""
    found = {}
    for child in driver.children(recursive=True):
        if child.pid != os.getpid():
            try:
                found[child.pid] = child.create_time()
            except psutil.NoSuchProcess:
                pass
    return found


def _alive(pid: int, started: float) -> psutil.Process | None:
    try:
        process = psutil.Process(pid)
        return process if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def watch(driver_pid: int) -> None:
    """Record the driver's descendants until stdin closes, then make sure every one of them has ended."""
    seen: dict[int, float] = {}
    try:
        driver = psutil.Process(driver_pid)
        while True:
            seen.update(_descendants(driver))
            ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
            if ready and not os.read(sys.stdin.fileno(), 4096):
                break
    except psutil.NoSuchProcess:
        pass
    deadline = time.monotonic() + GRACE_S
    while (left := [p for pid, started in seen.items() if (p := _alive(pid, started))]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a terminated driver still closes the pipe
    watch(int(sys.argv[1]))
