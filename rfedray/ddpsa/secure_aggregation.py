"""Secure aggregation by additive secret sharing over the prime field GF(2^61 - 1).

Protocol (full threshold, honest-but-curious aggregators and server, S >= 2 aggregators):

1. A client privatises its update first (the DP noise is added before anything leaves it),
   encodes it in fixed point (:class:`FixedPointCodec`) and splits the encoded vector ``v`` into
   ``S`` shares ``r_1, ..., r_{S-1}`` uniform on the field and ``r_S = v - sum r_j (mod p)``. Any
   ``S - 1`` shares are jointly uniform, whatever ``v`` is: an aggregator (or any coalition of at
   most ``S - 1`` of them) learns nothing about the update.
2. The client sends share ``j`` to aggregator ``j`` once its whole update is ready (it never sends
   a partial update).
3. Dropouts: a client may fail before sending, or between two sends. The server asks every
   aggregator which clients it holds a share from and keeps the intersection ``P``: exactly the
   clients whose ``S`` shares all arrived. Each aggregator returns ``sum_{i in P} r_{i,j} (mod p)``
   and discards every share of the round, including those of clients outside ``P`` (their partial
   shares are uniform noise and are never used).
4. The server adds the ``S`` partial sums (mod p) and decodes ``sum_{i in P} v_i``: it sees the sum
   only. An aggregator answers at most one partial sum per round and refuses sets of fewer than
   ``min_clients`` clients, so the server cannot difference two subsets or isolate one client.

Fixed-point encoding: ``x -> k = round(x * 2^frac_bits)``, stored as ``k mod p`` (negatives wrap to
the upper half of the field), and back by the centred lift. A sum of ``max_parties`` encoded values
never wraps when every ``|k| <= K = floor((p - 1) / 2 / max_parties)``, so the range is checked on
the rounded integer ``k`` itself (a check on ``|x|`` alone let values at the boundary round up past
``K``: 1,024 values at the limit decoded with the sign flipped); ``max_abs = K / 2^frac_bits`` is
the largest magnitude accepted. The decoded sum of ``n`` values is within ``n / 2^(frac_bits + 1)``
of the plain sum. With the defaults (24 fractional bits, 1,024 parties) that is
``|x| <= (2^50 - 1) / 2^24 ~ 6.7e7`` and a precision of ``3e-8`` per summand.

Randomness of the shares comes from the operating system (``os.urandom``); a seeded numpy generator
may be passed for reproducible experiments (not for production).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np

PRIME = (1 << 61) - 1


@dataclass(frozen=True)
class FixedPointCodec:
    """Real vectors to field elements and back.

    Parameters
    ----------
    frac_bits : int
        Fractional bits; the scale is ``2^frac_bits``. Between 0 and 40.
    max_parties : int
        Largest number of encoded vectors that may be summed without wrapping, >= 1.
    """

    frac_bits: int = 24
    max_parties: int = 1024

    def __post_init__(self):
        if not (0 <= self.frac_bits <= 40):
            raise ValueError(f"frac_bits={self.frac_bits}: must be an integer in [0, 40]")
        if self.max_parties < 1:
            raise ValueError(f"max_parties={self.max_parties}: must be an integer >= 1")
        if self.max_abs < 1.0:
            raise ValueError(f"frac_bits={self.frac_bits}, max_parties={self.max_parties}: leave no range "
                             "(max_abs < 1); lower one of them")

    @property
    def scale(self) -> int:
        return 1 << self.frac_bits

    @property
    def max_integer(self) -> int:
        """``K``: the largest magnitude of an encoded integer, so that ``max_parties`` of them never wrap."""
        return ((PRIME - 1) // 2) // self.max_parties

    @property
    def max_abs(self) -> float:
        """The largest magnitude a coordinate may have: ``K / 2^frac_bits``, rounded down to a float64."""
        bound = float(self.max_integer)
        if int(bound) > self.max_integer:  # K has more than 53 bits: take the float below
            bound = math.nextafter(bound, 0.0)
        return bound / self.scale

    @property
    def resolution(self) -> float:
        """Rounding error bound of one encoded value, ``2^-(frac_bits+1)``."""
        return 0.5 / self.scale

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Field elements (int64 in ``[0, p)``) of the real array ``x``.

        Raises
        ------
        ValueError
            If a coordinate is not finite or exceeds :attr:`max_abs` in magnitude.
        """
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError("x: every coordinate must be finite to be encoded")
        k = np.rint(x * self.scale)
        if x.size and float(np.max(np.abs(k))) > self.max_integer:
            raise ValueError(f"x: a coordinate exceeds the codec's range max_abs={self.max_abs:.4g} "
                             f"(frac_bits={self.frac_bits}, max_parties={self.max_parties})")
        return np.mod(k.astype(np.int64), PRIME)

    def decode(self, v: np.ndarray) -> np.ndarray:
        """Reals from field elements (centred lift: the upper half of the field is negative)."""
        v = np.asarray(v, dtype=np.int64)
        signed = np.where(v > (PRIME - 1) // 2, v - PRIME, v)
        return signed.astype(np.float64) / self.scale


def uniform_field(size: int, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """``size`` independent uniform elements of GF(p) as int64.

    Without ``rng`` the bits come from ``os.urandom`` (61 of every 64, the value ``p`` itself
    rejected and redrawn); with ``rng`` from the seeded generator (reproducible, not for production).
    """
    if rng is not None:
        return rng.integers(0, PRIME, size=size, dtype=np.int64)
    out = np.frombuffer(os.urandom(8 * size), dtype=np.uint64) >> np.uint64(3)
    bad = out == PRIME
    while bad.any():
        out[bad] = np.frombuffer(os.urandom(8 * int(bad.sum())), dtype=np.uint64) >> np.uint64(3)
        bad = out == PRIME
    return out.astype(np.int64)


def split_shares(v: np.ndarray, n_shares: int, rng: Optional[np.random.Generator] = None) -> list[np.ndarray]:
    """Additive shares of the field vector ``v``: ``n_shares`` vectors summing to ``v`` mod p.

    Parameters
    ----------
    v : array of int64 in [0, p)
    n_shares : int
        At least 2.
    rng : numpy Generator, optional
        Seeded randomness for experiments; OS entropy otherwise.
    """
    if n_shares < 2:
        raise ValueError(f"n_shares={n_shares}: must be >= 2 (one share would be the update itself)")
    v = np.asarray(v, dtype=np.int64).ravel()
    shares = [uniform_field(v.size, rng) for _ in range(n_shares - 1)]
    last = v.copy()
    for s in shares:
        last = np.mod(last - s, PRIME)
    return [*shares, last]


def field_sum(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Sum mod p of field vectors (each addition reduced, so int64 never overflows)."""
    total = np.zeros_like(np.asarray(vectors[0], dtype=np.int64))
    for v in vectors:
        total = np.mod(total + v, PRIME)
    return total


class ProtocolError(RuntimeError):
    """A secure-aggregation message out of protocol (duplicate share, second sum request, ...)."""


class ShareAggregator:
    """One intermediate aggregation server: holds shares, returns one partial sum per round.

    Parameters
    ----------
    index : int
        Which share (0-based) this aggregator receives.
    min_clients : int
        Smallest set of clients it will sum (>= 2 keeps a lone update from being revealed).
    """

    def __init__(self, index: int, min_clients: int = 2):
        if min_clients < 1:
            raise ValueError(f"min_clients={min_clients}: must be >= 1")
        self.index = index
        self.min_clients = min_clients
        self._shares: dict[int, dict[int, np.ndarray]] = {}
        self._answered: set[int] = set()

    def receive(self, round_index: int, client_id: int, share: np.ndarray) -> None:
        """Store the share of ``client_id`` for ``round_index``."""
        if round_index in self._answered:
            raise ProtocolError(f"aggregator {self.index}: round {round_index} is closed")
        held = self._shares.setdefault(round_index, {})
        if client_id in held:
            raise ProtocolError(f"aggregator {self.index}: second share from client {client_id} in round {round_index}")
        held[client_id] = np.asarray(share, dtype=np.int64)

    def received(self, round_index: int) -> list[int]:
        """The clients it holds a share from in ``round_index``."""
        return sorted(self._shares.get(round_index, {}))

    def partial_sum(self, round_index: int, client_ids: Sequence[int]) -> np.ndarray:
        """``sum of the shares of client_ids`` mod p; then every share of the round is discarded.

        Raises
        ------
        ProtocolError
            A second request in the same round, a set smaller than ``min_clients``, or a client
            it holds no share from.
        """
        if round_index in self._answered:
            raise ProtocolError(f"aggregator {self.index}: round {round_index} was already summed")
        ids = sorted(set(client_ids))
        held = self._shares.get(round_index, {})
        missing = [c for c in ids if c not in held]
        if missing:
            raise ProtocolError(f"aggregator {self.index}: no share from clients {missing} in round {round_index}")
        if len(ids) < self.min_clients:
            self.discard(round_index)
            raise ProtocolError(f"aggregator {self.index}: refuses to sum {len(ids)} < min_clients={self.min_clients} updates")
        total = field_sum([held[c] for c in ids])
        self.discard(round_index)
        self._answered.add(round_index)
        return total

    def discard(self, round_index: int) -> None:
        """Forget every share of ``round_index``."""
        self._shares.pop(round_index, None)


class AggregatorGroup(Protocol):
    """How clients and the server reach the S aggregators (local objects or Ray actors)."""

    num_aggregators: int

    def send(self, index: int, round_index: int, client_id: int, share: np.ndarray) -> None: ...

    def received(self, round_index: int) -> list[list[int]]: ...

    def partial_sums(self, round_index: int, client_ids: Sequence[int]) -> list[np.ndarray]: ...

    def discard(self, round_index: int) -> None: ...


class LocalAggregators:
    """S :class:`ShareAggregator` objects in this process (the local engine)."""

    def __init__(self, num_aggregators: int, min_clients: int = 2):
        if num_aggregators < 2:
            raise ValueError(f"num_aggregators={num_aggregators}: must be >= 2")
        self.num_aggregators = num_aggregators
        self.aggregators = [ShareAggregator(j, min_clients) for j in range(num_aggregators)]

    def send(self, index, round_index, client_id, share):
        self.aggregators[index].receive(round_index, client_id, share)

    def received(self, round_index):
        return [a.received(round_index) for a in self.aggregators]

    def partial_sums(self, round_index, client_ids):
        return [a.partial_sum(round_index, client_ids) for a in self.aggregators]

    def discard(self, round_index):
        for a in self.aggregators:
            a.discard(round_index)


def send_update(group: AggregatorGroup, codec: FixedPointCodec, round_index: int, client_id: int,
                update: np.ndarray, rng: Optional[np.random.Generator] = None) -> None:
    """Client side: encode the (already privatised) update, split it, send share j to aggregator j."""
    shares = split_shares(codec.encode(update), group.num_aggregators, rng)
    for j, share in enumerate(shares):
        group.send(j, round_index, client_id, share)


@dataclass
class SecureSum:
    """What the server learns in a round: the decoded sum and who is in it."""

    total: Optional[np.ndarray]
    participants: list[int]
    dropped: list[int]


def collect_sum(group: AggregatorGroup, codec: FixedPointCodec, round_index: int, min_clients: int = 2,
                among: Optional[Sequence[int]] = None) -> SecureSum:
    """Server side: the sum over the clients whose every share arrived (see the module docstring).

    ``among`` restricts the sum to those clients (the others count as dropped). Returns
    ``total=None`` (and discards the round everywhere) when fewer than ``min_clients`` clients
    completed.
    """
    views = group.received(round_index)
    complete = sorted(set.intersection(*(set(v) for v in views))) if views else []
    if among is not None:
        complete = sorted(set(complete) & set(among))
    dropped = sorted(set().union(*(set(v) for v in views)) - set(complete))
    if len(complete) < min_clients:
        group.discard(round_index)
        return SecureSum(None, complete, dropped)
    partials = group.partial_sums(round_index, complete)
    return SecureSum(codec.decode(field_sum(partials)), complete, dropped)
