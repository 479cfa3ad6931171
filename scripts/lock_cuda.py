"""Write constraints-cuda.txt: the exact CUDA wheels that the pinned torch pulls on Linux x86_64 GPU nodes.

``constraints.txt`` is what pip resolved and installed for this project (Python 3.11); on a Linux
x86_64 node, PyPI's ``torch`` wheel brings its own CUDA libraries (``nvidia-*``, ``cuda-toolkit``,
``triton``, ...) that a CPU machine never installs, so they are not in it. This script asks the same
resolver, pip, what it would install for the pinned torch on such a node, without installing or
downloading the wheels (``pip install --dry-run --report``, platform and Python given explicitly,
PyPI only), and writes the packages that ``constraints.txt`` does not already pin. Nodes install
with both files::

    pip install -c constraints.txt -c constraints-cuda.txt "torch==$(grep '^torch==' constraints.txt | cut -d= -f3)"

Run after changing the torch pin: ``python scripts/lock_cuda.py`` (needs PyPI; about a minute).
``tests/test_cuda_image.py`` checks the result against the pin, the Dockerfile's CUDA image and the
cloud images' drivers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
CUDA_CONSTRAINTS = ROOT / "constraints-cuda.txt"
PYTHON = "3.11"
INDEX = "https://pypi.org/simple"
# manylinux tags a glibc 2.28+ x86_64 node accepts (pip takes --platform literally, without the
# older tags it would accept when installing natively).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64",
]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a constraints file (canonical names)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonical(name)] = version.strip()
    return out


def resolve(torch_version: str) -> list[tuple[str, str]]:
    """``(name, version)`` of every wheel pip would install for torch on a Linux x86_64 CPython node."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_CONSTRAINT="")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), "--target", str(Path(tmp) / "target"), "--index-url", INDEX,
            "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
            "--abi", f"cp{PYTHON.replace('.', '')}", *(f"--platform={p}" for p in PLATFORMS),
            "-c", str(CONSTRAINTS), f"torch=={torch_version}",
        ]
        subprocess.run(command, env=env, check=True)
        installed = json.loads(report.read_text())["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in installed]


def main() -> int:
    pinned = pins(CONSTRAINTS)
    torch_version = pinned["torch"]
    pip_version = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True,
                                 check=True).stdout.split()[1]
    resolved = resolve(torch_version)
    for name, version in resolved:
        if canonical(name) in pinned and pinned[canonical(name)] != version:
            print(f"error: pip resolved {name}=={version} for the CUDA wheels but constraints.txt pins "
                  f"{pinned[canonical(name)]}", file=sys.stderr)
            return 1
    extra = sorted((n, v) for n, v in resolved if canonical(n) not in pinned)
    header = [
        f"# The Linux x86_64 CUDA wheels of torch=={torch_version} (PyPI), resolved by pip {pip_version} for",
        f"# CPython {PYTHON} with constraints.txt, beside which nodes install them:",
        "#   pip install -c constraints.txt -c constraints-cuda.txt torch==" + torch_version,
        "# Made by `python scripts/lock_cuda.py`; do not edit by hand.",
    ]
    CUDA_CONSTRAINTS.write_text("\n".join(header + [f"{n}=={v}" for n, v in extra]) + "\n")
    print(f"{CUDA_CONSTRAINTS.name}: {len(extra)} packages for torch=={torch_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
