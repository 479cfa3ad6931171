"""How tensors travel between processes: as numpy arrays where they can.

Pickling a torch tensor serialises its storage through ``torch.save`` (a few hundred microseconds
a tensor, each way, whatever its size), while numpy arrays travel as raw buffers (Ray passes them
out of band). A client actor returns one :class:`~rfedray.federated.client.LocalResult` per client
of a round: sending their tensors as arrays took ~5 ms off a Ray call of 10 small clients on a
2-core machine (``benchmarks/bench_engines.py``). The values are the same bits.

:func:`to_arrays` and :func:`from_arrays` map over nested dicts, lists and tuples; a tensor numpy
cannot hold (bfloat16, a tensor on a device, a sparse or quantised one) travels as a tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch


class Array:
    """A CPU tensor in transit: its values as a numpy array (and nothing else of the tensor's).

    Parameters
    ----------
    values : numpy.ndarray
        The tensor's values, ``(*shape)``.
    """

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values

    def __reduce__(self):
        return (Array, (self.values,))

    def tensor(self) -> torch.Tensor:
        """The tensor again (owning its memory: a received buffer may be read-only or shared)."""
        values = self.values if self.values.flags.writeable and self.values.flags.owndata else self.values.copy()
        return torch.from_numpy(values)


def _as_array(tensor: torch.Tensor) -> Array | torch.Tensor:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return tensor
    try:
        return Array(tensor.detach().resolve_conj().resolve_neg().contiguous().numpy())
    except TypeError:  # a dtype numpy has no equivalent of (bfloat16, float8)
        return tensor


def map_tree(tree: Any, leaf: type, fn: Callable[[Any], Any]) -> Any:
    """``tree`` with ``fn`` applied to every value of type ``leaf``, through mappings (made dicts),
    lists and tuples; any other value as it is."""
    if isinstance(tree, leaf):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: map_tree(v, leaf, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(v, leaf, fn) for v in tree)
    return tree


def to_arrays(tree: Any) -> Any:
    """``tree`` with every plain CPU tensor replaced by an :class:`Array` (dicts, lists, tuples)."""
    return map_tree(tree, torch.Tensor, _as_array)


def from_arrays(tree: Any) -> Any:
    """The inverse of :func:`to_arrays`: every :class:`Array` back to a tensor."""
    return map_tree(tree, Array, Array.tensor)
