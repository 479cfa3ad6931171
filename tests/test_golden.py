"""Golden outputs: the seeded runs of ``scripts/golden.py`` give the bits recorded in ``tests/golden/``.

The default job, an SPDNet run, a FedNewton run and a DDP-SA run, each on the local engine, and the
default job on the Ray engine (the other Ray runs are ``slow``). A refactoring must leave every
final model (SHA-256 of its bytes), summary and ``metrics.jsonl`` line as recorded; a change meant to
change the numbers re-records them (``python scripts/golden.py record``) and says why.
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("golden", ROOT / "scripts" / "golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def check(name: str, engine: str) -> None:
    diffs = golden.compare(name, engine)
    assert not diffs, f"{name} on the {engine} engine differs from tests/golden/{name}-{engine}.json:\n" + "\n".join(diffs[:30])


@pytest.mark.parametrize("name", list(golden.RUNS))
def test_local_engine_reproduces_the_golden_outputs(name):
    check(name, "local")


@pytest.fixture(scope="module")
def ray_instance():
    with golden.ray_instance():
        yield


@pytest.mark.parametrize("name", [
    "fedpca", *(pytest.param(n, marks=pytest.mark.slow) for n in golden.RUNS if n != "fedpca"),
])
def test_ray_engine_reproduces_the_golden_outputs(name, ray_instance):
    check(name, "ray")


def test_local_and_ray_engines_give_the_same_model():
    """The engines run the same loop and the same client computations: the recorded models agree."""
    import json

    for name in ("fedpca", "spdnet"):
        local, ray = (json.loads(golden.golden_path(name, e).read_text()) for e in golden.ENGINES)
        assert local["model_sha256"] == ray["model_sha256"], name
        assert local["metrics"] == ray["metrics"], name


def test_a_changed_bit_is_a_difference():
    """The comparison is exact: one float moved by one ulp, or a metric line dropped, is reported."""
    import math

    expected = {"summary": {"epsilon_spent": 1.0}, "metrics": [{"round": 0}], "model": {"w": [0.5]}}
    moved = {"summary": {"epsilon_spent": math.nextafter(1.0, 2.0)}, "metrics": [{"round": 0}], "model": {"w": [0.5]}}
    assert golden._differences(expected, moved)
    assert golden._differences(expected, {**expected, "metrics": []})
    assert not golden._differences(expected, dict(expected))
