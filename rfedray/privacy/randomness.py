"""The randomness of the private mechanisms: a ChaCha20 keystream, keyed by 256 secret bits.

Every private release of rfedray (DP-RFedProj's steps, the M-estimation strategies, DDP-SA) draws
its minibatch indices and its noise from a :class:`SecureGenerator`. The guarantee assumes the
server cannot predict that randomness: a server that could recompute a client's noise would
subtract it from the submission and see the clipped mean of the minibatch in the clear. So the
generator is a cryptographic one:

* its state is a 256-bit ChaCha20 key (RFC 8439, from the ``cryptography`` package), drawn from the
  operating system's entropy (:func:`secrets.token_bytes`) for every client and round. Recovering it
  from the outputs means breaking ChaCha20; a generator such as torch's MT19937, whose CPU seed
  keeps 32 bits, can be found by a scan of 2^32 seeds;
* reproducible experiments (``privacy.noise_seed``, any integer in ``[0, 2^128)``) derive the key
  with HKDF-SHA256 from the seed and a context (client, round): two seeds differing in any bit give
  unrelated streams, and the same seed gives the same bits in every process (both engines);
* uniforms carry 53 random bits (``k 2^-53``, ``k`` uniform on ``[0, 2^53)``); Gaussians are drawn
  in float64 by the Box-Muller transform (the radius ``sqrt(-2 ln(1 - u))`` reaches
  ``sqrt(106 ln 2) = 8.57`` standard deviations, a tail cut at probability ``2^-53``, far below any
  delta), and a mechanism scales them in float64 before casting to the model's dtype. torch's
  float32 ``randn`` draws from 24-bit uniforms and never exceeds 5.77 standard deviations: a
  truncated distribution the accountant does not describe;
* a minibatch is the ``B`` smallest of ``m`` independent 64-bit keys: a uniform ``B``-subset
  (ties, the only bias, have probability below ``m^2 2^-65``).

Draws are made on the CPU and moved to the generator's device (a CUDA model gets CUDA tensors).
:func:`subsets_and_normals` makes one step's draws of several generators at once, each generator's
the same bits as drawn alone.
"""

from __future__ import annotations

import math
import numbers
import secrets
import struct
from typing import Optional, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

from rfedray.privacy import checks

SEED_BITS = 128
"""``privacy.noise_seed`` is an integer in ``[0, 2^SEED_BITS)``."""

KEY_BYTES = 32
_INFO = b"rfedray/noise/chacha20/v1"
_TWO_PI = 2.0 * math.pi
_SHIFT = np.uint64(11)
_ULP = 2.0**-53


def check_seed(seed: object, name: str = "seed") -> int:
    """``seed`` as an int, checked to be an integer in ``[0, 2^128)``."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 1 << SEED_BITS:
        raise checks.PrivacyParameterError(name, seed, f"must be None (OS entropy) or an integer in [0, 2^{SEED_BITS})")
    return int(seed)


def derive_key(seed: int, context: Sequence[int] = ()) -> bytes:
    """The 256-bit key of a seeded stream: HKDF-SHA256 of the seed (16 bytes) and the context.

    Parameters
    ----------
    seed : int
        In ``[0, 2^128)``.
    context : sequence of int
        Non-negative integers below 2^64 naming the stream, e.g. ``(client_id, round)``.

    Returns
    -------
    bytes
        32 bytes.
    """
    seed = check_seed(seed)
    info = _INFO + struct.pack(f">{len(context)}Q", *context)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(seed.to_bytes(16, "little"))


class SecureGenerator:
    """A stream of random numbers read from a ChaCha20 keystream (see the module docstring).

    Parameters
    ----------
    key : bytes
        32 secret bytes.
    device : str or torch.device
        Where tensors drawn from it are delivered (the draws themselves are made on the CPU).
    """

    def __init__(self, key: bytes, device: str | torch.device = "cpu"):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise checks.PrivacyParameterError("key", "<secret>", f"must be {KEY_BYTES} bytes")
        self._stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
        self.device = torch.device(device)

    def words(self, count: int) -> np.ndarray:
        """``count`` uniform 64-bit words, ``uint64`` array of shape ``(count,)``."""
        out = np.empty(count, dtype=np.uint64)
        self._fill(out)
        return out

    def _fill(self, out: np.ndarray) -> None:
        """The stream's next ``len(out)`` words into ``out``, a C-contiguous ``uint64`` array of shape
        ``(count,)`` (the same words :meth:`words` would return)."""
        if len(out):
            self._stream.update_into(bytes(8 * len(out)), memoryview(out).cast("B"))

    def _uniform(self, count: int) -> np.ndarray:
        return _uniforms(self.words(count))

    def uniform(self, count: int) -> Tensor:
        """``count`` uniforms on ``[0, 1)`` with 53 random bits each (``k 2^-53``): float64, shape
        ``(count,)``, on :attr:`device`."""
        return self._deliver(self._uniform(count), (count,))

    def standard_normal(self, shape: Sequence[int]) -> Tensor:
        """I.i.d. ``N(0, 1)`` in float64 by Box-Muller, shape ``shape``, on :attr:`device`.

        A pair of uniforms ``(u, v)`` gives ``r cos(2 pi v)`` and ``r sin(2 pi v)`` with
        ``r = sqrt(-2 ln(1 - u))``: both Gaussian and independent, exactly up to the uniforms'
        ``2^-53`` resolution.
        """
        count = math.prod(shape)
        return self._deliver(_box_muller(self._uniform(_normal_words(count)))[:count], shape)

    def laplace(self, shape: Sequence[int], scale: float) -> Tensor:
        """I.i.d. Laplace(0, ``scale``) in float64, shape ``shape``, on :attr:`device`: the difference of two
        exponentials ``-ln(1 - u)`` (finite for every draw)."""
        count = math.prod(shape)
        u = self._uniform(2 * count)
        return self._deliver(scale * (np.log1p(-u[count:]) - np.log1p(-u[:count])), shape)

    def subset(self, num_records: int, size: int) -> Tensor:
        """``size`` distinct indices of ``range(num_records)``, every subset equally likely.

        The indices of the ``size`` smallest of ``num_records`` independent uniform 64-bit keys;
        int64, shape ``(size,)``, on :attr:`device`.
        """
        return _on(_smallest_keys(self.words(num_records), size), self.device)

    def _deliver(self, values: np.ndarray, shape: Sequence[int]) -> Tensor:
        return _on(torch.from_numpy(values).view(tuple(shape)), self.device)


def subsets_and_normals(
    generators: Sequence[SecureGenerator], num_records: Sequence[int], size: int, shapes: Sequence[Sequence[int]]
) -> tuple[Tensor, list[Tensor]]:
    """What each of K generators gives for :meth:`~SecureGenerator.subset` followed by
    :meth:`~SecureGenerator.standard_normal` of every shape of ``shapes`` (in that order), drawn for the
    K generators at once: the same words of every generator's stream, the same bits.

    Each generator reads its words in one call; the uniforms, the Box-Muller transform and the
    selection of the ``size`` smallest keys then run once over the K generators' rows: numpy's
    elementwise functions and torch's ``topk`` compute every row as they do alone, which
    ``tests/test_noise_source.py`` checks. This is what makes the draws of K clients' steps cheaper
    together than one by one (:func:`rfedray.federated.client.train_together`).

    Parameters
    ----------
    generators : sequence of SecureGenerator
        K >= 1 generators delivering on one device.
    num_records : sequence of int
        Per generator, the ``num_records`` of its subset (checked by the caller: ``1 <= size <= m``).
    size : int
        The subsets' size.
    shapes : sequence of shape
        The shapes of the normal draws following the subset (none: the subset only).

    Returns
    -------
    index : Tensor
        int64, shape ``(K, size)``: row ``i`` is ``generators[i].subset(num_records[i], size)``.
    normals : list of Tensor
        float64, one per shape, ``(K, *shape)``: row ``i`` is ``generators[i].standard_normal(shape)``.
    """
    device = generators[0].device
    if any(g.device != device for g in generators):
        raise ValueError(f"generators delivering on {sorted({str(g.device) for g in generators})}: "
                         "subsets_and_normals draws for one device")
    k, widths = len(generators), [_normal_words(math.prod(shape)) for shape in shapes]
    m = num_records[0]
    if all(n == m for n in num_records):
        words = np.empty((k, m + sum(widths)), dtype=np.uint64)
        for i, generator in enumerate(generators):
            generator._fill(words[i])
        index = _smallest_keys(words[:, :m], size)
        u = _uniforms(words[:, m:])
    else:
        rows = [g.words(n + sum(widths)) for g, n in zip(generators, num_records)]
        index = torch.stack([_smallest_keys(row[:n], size) for row, n in zip(rows, num_records)])
        u = _uniforms(np.stack([row[n:] for row, n in zip(rows, num_records)]))
    normals, start = [], 0
    for shape, width in zip(shapes, widths):
        z = _box_muller(u[:, start:start + width])[:, :math.prod(shape)]
        normals.append(_on(torch.from_numpy(np.ascontiguousarray(z)).view((k, *shape)), device))
        start += width
    return _on(index, device), normals


def _normal_words(count: int) -> int:
    """The words :meth:`SecureGenerator.standard_normal` reads for ``count`` normals: one pair per two."""
    return 2 * ((count + 1) // 2)


def _uniforms(words: np.ndarray) -> np.ndarray:
    """Uniforms on ``[0, 1)`` with 53 random bits each, float64, the shape of ``words`` (uint64)."""
    return (words >> _SHIFT).astype(np.float64) * _ULP


def _box_muller(u: np.ndarray) -> np.ndarray:
    """Standard normals from uniforms ``u`` of shape ``(..., 2 pairs)``: along the last axis the first
    ``pairs`` give the radii, the last ``pairs`` the angles; the cosines then the sines, same shape."""
    pairs = u.shape[-1] // 2
    radius = np.sqrt(-2.0 * np.log1p(-u[..., :pairs]))
    angle = _TWO_PI * u[..., pairs:]
    z = np.empty(u.shape)
    np.multiply(radius, np.cos(angle), out=z[..., :pairs])
    np.multiply(radius, np.sin(angle), out=z[..., pairs:])
    return z


def _smallest_keys(words: np.ndarray, size: int) -> Tensor:
    """The indices of the ``size`` smallest keys along the last axis of ``words`` (uint64 read as
    int64), int64 of shape ``(..., size)``, in ``topk``'s order."""
    return torch.topk(torch.from_numpy(words.view(np.int64)), size, largest=False, sorted=False).indices


def _on(t: Tensor, device: torch.device) -> Tensor:
    return t if device.type == "cpu" else t.to(device)


def seeded_or_fresh(seed: Optional[int], context: Sequence[int] = (), device: str | torch.device = "cpu") -> SecureGenerator:
    """A generator keyed by :func:`derive_key` of ``seed`` and ``context`` when ``seed`` is given
    (reproducible, not for production), else by 256 bits of operating-system entropy."""
    key = secrets.token_bytes(KEY_BYTES) if seed is None else derive_key(seed, context)
    return SecureGenerator(key, device)
