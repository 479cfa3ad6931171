"""rfedray.federated.wire: tensors travel as numpy arrays where numpy can hold them, the same bits back."""

import pickle

import numpy as np
import pytest
import torch

from rfedray.federated.wire import Array, from_arrays, to_arrays

TENSORS = {
    "float32": torch.randn(3, 4),
    "float64 strided view": torch.randn(3, 4, dtype=torch.float64)[:, ::2],
    "zero-dimensional": torch.tensor(3),
    "bool": torch.tensor([True, False]),
    "requires grad": torch.randn(2, requires_grad=True) * 1,
    "conjugate view": torch.randn(2, dtype=torch.complex64).conj(),
    "negative view": torch.randn(2, dtype=torch.complex128)._neg_view(),
    "bfloat16 (no numpy dtype)": torch.randn(2, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", TENSORS)
def test_a_tensor_comes_back_the_same_bits(name):
    tensor = TENSORS[name]
    tree = {"a": [tensor, (tensor, 1)], "b": None}
    back = from_arrays(pickle.loads(pickle.dumps(to_arrays(tree))))
    for got in (back["a"][0], back["a"][1][0]):
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor.detach())
        assert not got.requires_grad
    assert back["a"][1][1] == 1 and back["b"] is None and isinstance(back["a"][1], tuple)


def test_plain_tensors_travel_as_arrays_and_others_as_tensors():
    sent = to_arrays({"plain": torch.ones(2), "bf16": torch.ones(2, dtype=torch.bfloat16), "sparse": torch.eye(2).to_sparse()})
    assert isinstance(sent["plain"], Array) and isinstance(sent["plain"].values, np.ndarray)
    assert isinstance(sent["bf16"], torch.Tensor) and isinstance(sent["sparse"], torch.Tensor)


def test_a_received_read_only_buffer_is_copied():
    values = np.arange(4.0)
    values.flags.writeable = False
    tensor = Array(values).tensor()
    tensor.add_(1)  # its own memory: the received buffer is untouched
    assert values.tolist() == [0.0, 1.0, 2.0, 3.0] and tensor.tolist() == [1.0, 2.0, 3.0, 4.0]
