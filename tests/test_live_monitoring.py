"""Issue 18: live monitoring as a person sees it: Prometheus's graph page in a real browser, mid-run (slow).

A private SPDNet run (synthetic EEG, seeded, epsilon 20; its accuracy climbs from about 0.75 to 0.97
in 30 rounds) exports its metrics; a real Prometheus (Debian's) scrapes them every second; headless
Chromium (Debian's) opens Prometheus's graph page for ``rfedray_epsilon_spent`` and
``rfedray_test_accuracy`` twice while the run goes on: once its first round is in, then a few rounds
later, once the accuracy has risen (or the test fails after 10 minutes). Between the two screenshots
the values, read from Prometheus's API just after the first and just before the second, rise, and
the plotted curves grow. The screenshots are kept in the test's directory (``monitoring/live-monitoring.png`` is one).

Run: ``.venv/bin/python -m pytest -m slow tests/test_live_monitoring.py`` (about 3 minutes alone).
"""

import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prometheus_server import free_port, prometheus  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "model.name=spdnet", "data.source=synthetic_eeg", "model.options.d=4", "data.options.trials_per_client=96",
    "data.options.separation=2", "run.engine=local", "run.rounds=40", "federation.n_clients=4",
    "federation.clients_per_round=4", "federation.local_steps=2", "federation.batch_size=8", "optim.default.lr=0.05",
    "privacy.epsilon=20", "privacy.noise_seed=3", "monitoring.linger_seconds=60",
]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1700", "--virtual-time-budget=10000", "--hide-scrollbars",
]
EXPRESSIONS = ("rfedray_epsilon_spent", "rfedray_test_accuracy")


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium not found on PATH: install Debian's chromium (`bash scripts/setup.sh --test` does it)",
                    pytrace=False)
    return path


def graph_url(prometheus_url: str) -> str:
    """Prometheus's graph page with one graph per expression, the last two minutes."""
    params = {}
    for i, expr in enumerate(EXPRESSIONS):
        params.update({f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.range_input": "2m"})
    return f"{prometheus_url}/graph?{urllib.parse.urlencode(params)}"


def screenshot(url: str, path: Path, profile: Path) -> None:
    """A headless Chromium screenshot of ``url`` (a fresh profile each time)."""
    result = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={path}", url],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and path.is_file(), result.stderr[-2000:]


def curve_columns(path: Path) -> int:
    """Columns of the image crossed by a plotted curve: saturated colours (the page itself is grey,
    white and blue). The graphs' time axes are fixed, so a curve that grows covers more columns;
    its pixel count alone may not grow (the value axis rescales as the values rise)."""
    rgb = np.asarray(Image.open(path).convert("RGB")).astype(int)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    curve = (r - np.maximum(g, b) > 80) | (g - np.maximum(r, b) > 80)
    return int(curve.any(axis=0).sum())


def test_the_graph_page_shows_epsilon_and_accuracy_rising(tmp_path, prometheus):
    port = free_port()
    server = prometheus(f"127.0.0.1:{port}")
    run = subprocess.Popen(
        [sys.executable, "-m", "rfedray.cli", "run", *RUN, f"run.output_dir={tmp_path / 'runs'}",
         f"monitoring.metrics_port={port}", "--quiet"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = graph_url(server.url)
    try:
        server.wait_until("rfedray_current_round", lambda v: v >= 1, timeout=240)
        first = tmp_path / "live-1.png"
        screenshot(url, first, tmp_path / "profile-1")
        after_first = [server.value(e) for e in EXPRESSIONS]
        round_first = server.value("rfedray_current_round")

        # A few rounds on, once the accuracy has risen (the seeded run's accuracy climbs, with plateaus).
        server.wait_until("rfedray_current_round", lambda v: v >= round_first + 3, timeout=600)
        server.wait_until("rfedray_test_accuracy", lambda v: v > after_first[1], timeout=600)
        before_second = [server.value(e) for e in EXPRESSIONS]
        second = tmp_path / "live-2.png"
        screenshot(url, second, tmp_path / "profile-2")
        round_second = server.value("rfedray_current_round")
    finally:
        run.kill()
        run.wait(timeout=60)

    print(f"screenshots {first} (round {round_first:g}) and {second} (round {round_second:g})")
    (eps_1, acc_1), (eps_2, acc_2) = after_first, before_second
    assert eps_2 > eps_1 > 0 and acc_2 > acc_1 > 0.5, (after_first, before_second)
    for shot in (first, second):
        with Image.open(shot) as image:
            assert image.size == (1400, 1700)
    assert first.read_bytes() != second.read_bytes()
    assert curve_columns(second) > curve_columns(first) > 0  # the curves grew along the time axis
