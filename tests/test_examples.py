"""The runnable examples of the Python API, and the README's API section, which must be what they run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name, tmp_path, *args):
    """The example as a user runs it, from a folder of its own (its runs/ goes there); stdout lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "Token authentication is enabled" not in done.stderr  # rfedray's own Ray instance asks for it: no warning
    return done.stdout.splitlines()


def test_federated_pca_example_on_ray(tmp_path):
    run_dir, epsilon, gaps, rank = run_example("federated_pca.py", tmp_path, "--rounds", "4", "--engine", "ray")
    assert (tmp_path / run_dir / "summary.json").is_file() and Path(run_dir).parent == Path("runs")
    assert 0 < float(epsilon) <= 1.0
    gaps = [float(g) for g in gaps.strip("[]").split(",")]
    assert len(gaps) == 4 and gaps[-1] < gaps[0]
    assert float(rank) == pytest.approx(4.0, abs=1e-4)


def test_custom_model_example(tmp_path):
    run_dir, epsilon, accuracy, off_manifold = run_example("custom_model.py", tmp_path, "--rounds", "8")
    assert (tmp_path / run_dir / "summary.json").is_file() and Path(run_dir).name.startswith("custom-spdnet-")
    assert 0 < float(epsilon) <= 8.0
    assert float(accuracy) > 0.6  # two classes
    assert float(off_manifold) < 1e-5


def code_blocks(section: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_api_section_is_what_the_examples_run():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = code_blocks(section)
    assert len(blocks) == 2
    sources = {p.name: [line.strip() for line in p.read_text().splitlines() if line.strip()] for p in EXAMPLES.glob("*.py")}
    for block in blocks:
        wanted = [line.strip() for line in block.splitlines() if line.strip()]

        def in_order(lines):
            position = 0
            for line in wanted:
                if line not in lines[position:]:
                    return False
                position = lines.index(line, position) + 1
            return True

        assert any(in_order(lines) for lines in sources.values()), f"not in any example, in order:\n{block}"
