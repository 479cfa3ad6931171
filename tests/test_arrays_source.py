"""The arrays source reads a client's arrays from its file when they are loaded, and refuses a changed file."""

import os

import numpy as np
import pytest
import torch

from rfedray.data.arrays import ArraysFederation, Options
from rfedray.errors import RfedrayError
from rfedray.options import OptionsError


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


def test_a_file_is_checked_once_per_content_and_a_changed_file_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RFEDRAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "clients.npz"
    write(path, np.random.default_rng(0))
    options = Options(path=str(path), task="classification")
    first = ArraysFederation(options, n_clients=3)
    checks = []
    original = ArraysFederation._check
    monkeypatch.setattr(ArraysFederation, "_check", lambda self, arrays: checks.append(1) or original(self, arrays))
    again = ArraysFederation(options, n_clients=3)
    assert checks == [] and again.client_sizes() == first.client_sizes() and again.info == first.info
    ArraysFederation(Options(path=str(path), task="classification", num_classes=3), n_clients=3)
    assert checks == [1]  # other options: checked
    arrays = write(path, np.random.default_rng(0))
    arrays["x_2"][4, 1] = np.nan
    np.savez(path, **arrays)
    with pytest.raises(OptionsError, match=r"x_2 \(client 2\): record 4 is not finite \(nan\)"):
        ArraysFederation(options, n_clients=3)
    assert checks == [1, 1]
