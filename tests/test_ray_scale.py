"""500 simulated clients on the Ray engine on one small machine (slow).

Two client actors host 250 clients each (default: one actor per CPU); 50 clients per round. The
memory of every Ray process (the driver and all the processes the engine's Ray instance runs) must
stay under 6 GiB.
"""

import sys
from pathlib import Path

import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_engines import measure_engine  # noqa: E402

pytestmark = pytest.mark.slow


def test_500_clients_fit_in_6_gib(tmp_path):
    assert not ray.is_initialized()  # the engine starts its own Ray: all its processes are our descendants
    ray_run = measure_engine("ray", 500, 50, 5, str(tmp_path))
    print(f"\n500 clients, k=50: round {ray_run['round_s']:.3f} s (training {ray_run['train_s']:.3f} s); Ray "
          f"processes: peak RSS {ray_run['peak_rss_gib']:.2f} GiB")
    assert ray_run["failed"] == 0
    assert ray_run["peak_rss_gib"] < 6.0
    assert not ray.is_initialized()  # and shut it down
