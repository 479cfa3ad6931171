"""A real Prometheus server for tests: scrapes one target every second, queried over its HTTP API.

Use the ``prometheus`` fixture by importing it into a test module (pytest then finds it there)::

    from prometheus_server import prometheus  # noqa: F401  (a pytest fixture)

    def test_scrape(prometheus):
        server = prometheus("127.0.0.1:8000")           # started and ready
        server.wait_for_scrape()                         # the target was scraped and is up
        server.wait_until("rfedray_rounds_completed_total", lambda v: v == 3)
        samples = server.query("rfedray_epsilon_spent")  # [{"metric": {...}, "value": [t, "0.5"]}]

It runs the ``prometheus`` binary (Debian's package, installed by ``scripts/setup.sh --test``) on a
free loopback port with its configuration and TSDB in a temporary directory, and stops it at the
end of the test. A missing binary fails the test with a message saying how to install it: the
scrape tests are part of the suite and are never skipped.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

SCRAPE_INTERVAL_S = 1
INSTALL_HINT = (
    "install Debian's prometheus package (`bash scripts/setup.sh --test` does it, or "
    "`apt-get install -y prometheus`)"
)


def require_binary(name: str) -> str:
    """Path of ``name`` (``prometheus`` or ``promtool``) on PATH; fails the test when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: {INSTALL_HINT}", pytrace=False)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its API answered with an error."""


class PrometheusServer:
    """One Prometheus process scraping ``target`` (``host:port``, path ``/metrics``) every second.

    Parameters
    ----------
    target : str
        ``host:port`` of the endpoint to scrape.
    workdir : Path
        Empty directory for the configuration, the TSDB and the server's log.
    job : str
        Job label of the scraped series.
    startup_timeout : float
        Seconds to wait for ``/-/ready``.
    config : dict, optional
        A whole configuration to run instead of the one-target one (e.g. ``monitoring/prometheus.yml``
        with its paths adapted); files it names relative to itself go in ``workdir``.
    """

    def __init__(self, target: str, workdir: Path, *, job: str = "rfedray", startup_timeout: float = 30.0,
                 config: Optional[dict] = None):
        if ":" not in target:
            raise ValueError(f"target={target!r}: must be host:port")
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout={startup_timeout!r}: must be > 0")
        self.target = target
        self.job = job
        self.config = config
        self.workdir = Path(workdir)
        self.startup_timeout = startup_timeout
        self.port: Optional[int] = None
        self.process: Optional[subprocess.Popen] = None
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        config = self.config or {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": [self.target]}]}],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log, for failure messages."""
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> "PrometheusServer":
        """Start the server on a free loopback port and wait until it is ready (a few tries)."""
        binary = require_binary("prometheus")
        config = self._write_config()
        for _ in range(3):
            self.port = free_port()
            tsdb = self.workdir / f"tsdb-{self.port}"
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            if self._wait_ready():
                return self
            self.stop()
        raise PrometheusError(f"prometheus did not become ready; its log ends with:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _api(self, path: str, params: dict) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: Optional[float] = None) -> list[dict]:
        """Evaluate ``expr`` at time ``at`` (default now): the API's result list.

        For an instant vector each item is ``{"metric": {label: value}, "value": [t, "v"]}``; for a
        range vector (``expr[30s]``) ``{"metric": ..., "values": [[t, "v"], ...]}``.
        """
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._api("query", params)["result"]

    def value(self, expr: str) -> Optional[float]:
        """The value of a one-sample instant vector, or None when the result is empty."""
        result = self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"{expr!r} has {len(result)} series, expected one")
        return float(result[0]["value"][1])

    def wait_until(self, expr: str, predicate: Callable[[float], bool], timeout: float = 15.0) -> float:
        """Poll :meth:`value` until ``predicate`` holds; return the value, or fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.value(expr)
            if last is not None and predicate(last):
                return last
            time.sleep(SCRAPE_INTERVAL_S / 4)
        raise PrometheusError(f"{expr!r} did not reach the expected value in {timeout} s (last: {last})")

    def targets(self) -> list[dict]:
        """The active scrape targets, as ``/api/v1/targets`` reports them."""
        return self._api("targets", {"state": "active"})["activeTargets"]

    def wait_for_scrape(self, timeout: float = 15.0) -> None:
        """Wait until the target has been scraped successfully (``up == 1``)."""
        try:
            self.wait_until(f'up{{job="{self.job}"}}', lambda v: math.isclose(v, 1.0), timeout)
        except PrometheusError:
            health = [(t.get("scrapeUrl"), t.get("health"), t.get("lastError")) for t in self.targets()]
            raise PrometheusError(f"target {self.target} not scraped in {timeout} s: {health}") from None


@pytest.fixture
def prometheus(tmp_path_factory):
    """Factory fixture: ``prometheus("host:port")`` starts a ready server scraping that target.

    Every server started is stopped at teardown.
    """
    servers: list[PrometheusServer] = []

    def start(target: str, **kwargs) -> PrometheusServer:
        server = PrometheusServer(target, tmp_path_factory.mktemp("prometheus"), **kwargs)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
