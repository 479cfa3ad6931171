"""What this process's torch and the machine's NVIDIA driver can do together, in words.

A torch wheel is built for one CUDA version (torch 2.13.0 from PyPI: CUDA 13.0), and an NVIDIA
driver runs CUDA up to the version it reports (CUDA 13 needs a Linux driver >= 580.65.06). When they
disagree, ``torch.cuda.is_available()`` is False on a machine with a GPU. :func:`cuda_report` says
why, so that a client actor that Ray gave a GPU refuses to train on the CPU with a message an
operator can act on, and ``python -m rfedray.cuda`` (a GPU node's set-up check) exits 1 with it.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Optional

import torch

DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")

MINIMUM_DRIVER = {12: "525.60.13", 13: "580.65.06"}
"""The oldest Linux NVIDIA driver of each CUDA major version (NVIDIA's CUDA toolkit release notes)."""


def driver_version() -> Optional[str]:
    """The loaded NVIDIA kernel driver's version (e.g. ``580.95.05``), or None without one."""
    try:
        text = DRIVER_VERSION_FILE.read_text()
    except OSError:
        return None
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None


def driver_cuda_version() -> Optional[str]:
    """The newest CUDA version the installed driver supports (``cuDriverGetVersion``), or None."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def torch_cuda_problem() -> Optional[str]:
    """Why torch cannot use CUDA here (torch's own words), or None when it can."""
    if torch.cuda.is_available():
        return None
    try:
        torch.cuda.init()
    except Exception as exc:  # torch raises RuntimeError or AssertionError depending on the build
        lines = str(exc).strip().splitlines()
        return lines[0] if lines else type(exc).__name__
    return "torch.cuda.is_available() is False"


def cuda_report() -> str:
    """torch's CUDA build, the NVIDIA driver and the CUDA it supports, and torch's complaint, in one line."""
    build = torch.version.cuda
    if build:
        needs = MINIMUM_DRIVER.get(int(build.split(".")[0]))
        torch_part = f"torch {torch.__version__} is built for CUDA {build}" + (
            f" (needs an NVIDIA driver >= {needs})" if needs else "")
    else:
        torch_part = f"torch {torch.__version__} is a CPU-only build"
    driver, supported = driver_version(), driver_cuda_version()
    if driver is None and supported is None:
        driver_part = "no NVIDIA driver is loaded on this node"
    else:
        driver_part = f"NVIDIA driver {driver or 'of unknown version'}" + (
            f" supports CUDA up to {supported}" if supported else " (libcuda.so.1 not found)")
    problem = torch_cuda_problem()
    return f"{torch_part}; {driver_part}" + (f"; torch says: {problem}" if problem else "")


def main() -> int:
    """Print the report; exit status 0 when torch can use a GPU here, 1 otherwise."""
    if torch.cuda.is_available():
        print(f"ok: {torch.cuda.get_device_name(0)}; {cuda_report()}")
        return 0
    print(f"error: torch cannot use a GPU on this node: {cuda_report()}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
