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
        if count:
            self._stream.update_into(bytes(8 * count), memoryview(out).cast("B"))
        return out

    def _uniform(self, count: int) -> np.ndarray:
        return (self.words(count) >> _SHIFT).astype(np.float64) * _ULP

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
        pairs = (count + 1) // 2
        u = self._uniform(2 * pairs)
        radius = np.sqrt(-2.0 * np.log1p(-u[:pairs]))
        angle = _TWO_PI * u[pairs:]
        z = np.empty(2 * pairs)
        np.multiply(radius, np.cos(angle), out=z[:pairs])
        np.multiply(radius, np.sin(angle), out=z[pairs:])
        return self._deliver(z[:count], shape)

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
        keys = torch.from_numpy(self.words(num_records).view(np.int64))
        index = torch.topk(keys, size, largest=False, sorted=False).indices
        return index if self.device.type == "cpu" else index.to(self.device)

    def _deliver(self, values: np.ndarray, shape: Sequence[int]) -> Tensor:
        out = torch.from_numpy(values).view(tuple(shape))
        return out if self.device.type == "cpu" else out.to(self.device)


def seeded_or_fresh(seed: Optional[int], context: Sequence[int] = (), device: str | torch.device = "cpu") -> SecureGenerator:
    """A generator keyed by :func:`derive_key` of ``seed`` and ``context`` when ``seed`` is given
    (reproducible, not for production), else by 256 bits of operating-system entropy."""
    key = secrets.token_bytes(KEY_BYTES) if seed is None else derive_key(seed, context)
    return SecureGenerator(key, device)
