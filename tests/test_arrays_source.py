"""The arrays source reads a client's arrays from its file when they are loaded, and refuses a changed file."""

import os

import numpy as np
import pytest
import torch

from rfedray.data.arrays import ArraysFederation, Options
from rfedray.errors import RfedrayError


def write(path, rng, clients=3):
    arrays = {f"x_{i}": rng.standard_normal((20 + i, 5)) for i in range(clients)}
    arrays.update({f"y_{i}": np.arange(20 + i) % 2 for i in range(clients)})
    arrays["x_test"], arrays["y_test"] = rng.standard_normal((7, 5)), np.arange(7) % 2
    np.savez(path, **arrays)
    return arrays


def test_client_arrays_come_from_the_file_and_a_changed_file_is_refused(tmp_path):
    path = tmp_path / "clients.npz"
    arrays = write(path, np.random.default_rng(0))
    source = ArraysFederation(Options(path=str(path), task="classification"), n_clients=3)
    assert source.client_sizes() == [20, 21, 22]
    x, y = source.client_data(1).train
    torch.testing.assert_close(x, torch.as_tensor(arrays["x_1"], dtype=torch.float32))
    assert torch.equal(y, torch.as_tensor(arrays["y_1"]))
    write(path, np.random.default_rng(1))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(RfedrayError, match=r"data.options.path=.*changed after it was checked"):
        source.client_data(1)
