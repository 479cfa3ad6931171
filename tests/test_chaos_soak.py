"""Chaos soak (slow): 2,000 Ray rounds while client actors, the server actor and the driver are killed.

Runs ``scripts/chaos_soak.py`` (see its docstring for what it kills and checks) and prints its
report with ``-s``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_chaos_soak(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/chaos_soak.py", "--rounds", "2000", "--output-dir", str(tmp_path), "--deadline", "3300"],
        cwd=ROOT, capture_output=True, text=True, timeout=3500,
    )
    report = json.loads(out.stdout)
    print("\nchaos soak:", json.dumps(report, indent=2))
    assert report["ok"], (report, out.stderr[-2000:])
    assert report["kills"]["client_actor"] >= 10 and report["kills"]["server_actor"] == 1 and report["kills"]["driver"] == 1
    assert report["resumes"] >= 2
    assert all(report["checks"].values())
