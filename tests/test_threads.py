"""Threads chosen from the work: one for small minibatches, the process's CPUs for large ones."""

import pytest
import torch

from rfedray.config import ConfigError, load_config
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.runner import run_local
from rfedray.threads import PARALLEL_MIN_ELEMENTS, choose_threads


def test_small_minibatches_run_one_thread_large_ones_every_cpu():
    assert choose_threads(500, (40,), cpus=8) == 1            # federated PCA, Table 4
    assert choose_threads(64, (22, 22), cpus=8) == 1          # SPDNet, BNCI2014_001
    assert choose_threads(64, (22, 513), cpus=8) == 8         # EEGNet, BNCI2014_001
    assert choose_threads(1, (PARALLEL_MIN_ELEMENTS,), cpus=3) == 3
    assert choose_threads(1, (PARALLEL_MIN_ELEMENTS - 1,), cpus=3) == 1
    assert choose_threads(500, (40,), cpus=8, override=4) == 4


@pytest.mark.parametrize("value", ["0", "-2"])
def test_run_threads_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"run\.threads"):
        load_config(None, [f"run.threads={value}"])


@pytest.mark.parametrize("override, expected", [(None, 1), (2, 2)])
def test_local_engine_sets_its_threads(tmp_path, override, expected):
    overrides = ["run.rounds=1", "federation.n_clients=2", "federation.clients_per_round=1", "federation.batch_size=20",
                 "data.options.records_per_client=50", "data.options.d=6", "data.options.p=2", "privacy.sigma=1.0",
                 "privacy.epsilon=null", "privacy.accountant=exact", "monitoring.progress=false", f"run.output_dir={tmp_path}"]
    if override is not None:
        overrides.append(f"run.threads={override}")
    cfg = load_config(None, ["run.engine=local", *overrides])
    torch.set_num_threads(3)
    try:
        run_local(Federation.prepare(cfg, RunDirectory.create(str(tmp_path), f"threads-{override}")))
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(1)
