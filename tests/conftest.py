"""Shared test set-up: one torch thread per process, and no Ray connection left between modules.

On 2-core machines shared with Ray workers and other processes, two torch threads per process
made small linear algebra 5-50x slower; every test module runs with one thread.
"""

import sys

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def no_ray_left_running():
    """A module whose runs started Ray in this process (an engine's own local instance) shuts it down
    when it ends, so that the next module can start its own (``ray.cluster_utils.Cluster``, or a
    check that the engine's processes are all its descendants)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
