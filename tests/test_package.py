"""The installable package: a wheel built from the sources, installed into a fresh virtual environment
outside the checkout, runs the default job from a folder that is not the checkout.

The default test gives the fresh environment the dependencies of this one (the pinned packages
rfedray needs; torch alone is gigabytes) through a path entry, while rfedray itself comes only
from the wheel: the checkout is on no path, the editable install's import hook is not loaded there,
and ``rfedray.__file__`` is checked to lie in the fresh environment. ``pip check`` then confirms
that the wheel's declared dependencies are satisfied by those packages. The slow test installs
everything from scratch, as a user would (torch pinned first, then the wheel with constraints.txt).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import rfedray

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "rfedray", "actors", "configs")


def build_wheel(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the sources (the checkout gets no build/ or egg-info folder)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), "./src"], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("rfedray-*.whl")
    return wheel


def clean_env(home: Path) -> dict:
    """The environment of a user's shell: no PYTHONPATH into the checkout, caches in a fresh home."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RFEDRAY_CACHE_DIR")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_DATA_HOME=str(home / ".local/share"))
    return env


def run(args, cwd, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check_installed(python: Path, bindir: Path, tmp_path: Path) -> None:
    """What a user sees after ``pip install``: version, packaged configs, exit statuses, the default job."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = clean_env(home)
    where = run([python, "-c", "import rfedray, actors; print(rfedray.__file__); print(actors.__file__)"], work, env)
    assert where.returncode == 0, where.stderr
    assert all(Path(p).is_relative_to(python.parents[1]) for p in where.stdout.split()), where.stdout

    version = run([bindir / "rfedray", "--version"], work, env)
    assert version.returncode == 0 and version.stdout == f"rfedray {rfedray.__version__}\n"

    shown = run([bindir / "rfedray", "config", "show", "configs/eeg_physionet_spdnet.yaml"], work, env)
    assert shown.returncode == 0 and "name: eeg-physionet-spdnet" in shown.stdout, shown.stderr
    init = run([bindir / "rfedray", "config", "init", "my-configs"], work, env)
    assert init.returncode == 0 and (work / "my-configs" / "fedpca.yaml").read_text() == (ROOT / "configs" / "fedpca.yaml").read_text()

    usage = run([bindir / "rfedray", "run", "federation.clients_per_round=60"], work, env)
    assert usage.returncode == 2
    assert usage.stderr.strip().splitlines()[-1] == "error: federation.clients_per_round=60: must be between 1 and federation.n_clients (10)"
    assert run([bindir / "rfedray", "frobnicate"], work, env).returncode == 2

    site_packages = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, env).stdout.strip())
    shipped = set(site_packages.rglob("*.npz"))  # the dependencies' own data (scipy's, matplotlib's samples)
    job = run([bindir / "rfedray", "run", "run.engine=local", "run.rounds=3", "--quiet"], work, env)
    assert job.returncode == 0, job.stderr
    run_dir = work / job.stdout.splitlines()[0]
    assert run_dir.parent == work / "runs" and (run_dir / "summary.json").is_file() and (run_dir / "model_final.pt").is_file()
    assert job.stderr.strip().splitlines()[-1].startswith("done: 3 rounds, epsilon ")
    assert set(site_packages.rglob("*.npz")) == shipped and not (site_packages / "runs").exists()  # no cache written there


def test_the_wheel_works_in_a_fresh_environment_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    site_packages = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True).stdout.strip())
    # This environment's packages as a path entry: its .pth files (the editable install's hook) are not run.
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    installed = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert (site_packages / "rfedray" / "configs" / "fedpca.yaml").is_file()
    checked = subprocess.run([*pip, "check"], capture_output=True, text=True)
    assert "No broken requirements found." in checked.stdout, checked.stdout + checked.stderr
    check_installed(python, fresh / "bin", tmp_path)


@pytest.mark.slow
def test_the_wheel_installs_with_its_dependencies_from_scratch(tmp_path):
    """As a user would: a fresh venv, torch pinned first (a CPU wheel from the local index), then the wheel."""
    wheel = build_wheel(tmp_path)
    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "-c", str(ROOT / "constraints.txt")]
    torch_pin = next(line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    subprocess.run([*pip, torch_pin], check=True, capture_output=True, timeout=1800)
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True, timeout=1800)
    check_installed(python, fresh / "bin", tmp_path)
