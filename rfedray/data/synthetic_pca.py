"""Synthetic federated PCA data: heterogeneous clients sharing a top-p subspace.

Client ``i`` draws records ``z ~ N(0, Sigma_i)`` with ``Sigma_i = U_i diag(lambda) U_i^T + s^2 I``,
where ``U_i = Pi_St(U + h G_i)`` perturbs a common orthonormal basis ``U`` (d x p) by a client-specific
Gaussian matrix ``G_i`` scaled by the heterogeneity ``h``. Records are normalised to the norm
``radius`` (default 1), so every per-record gradient of the PCA loss ``-z^T P z`` is bounded: its
tangent norm ``sqrt(2) ||P z|| ||(I - P) z||`` is at most ``radius^2 / sqrt(2)``, below a clip ``C``
(where clipping never binds) when ``radius <= (sqrt(2) C)^(1/2)``. The pooled covariance of all training records defines the optimum ``P*`` that the
optimality gap is measured against.

Everything is a deterministic function of ``(seed, client_id)``, so any process can regenerate
any client's partition on its own: records never travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from rfedray.data.validation import available_memory
from rfedray.errors import ConfigError
from rfedray.options import DTYPES, NON_NEGATIVE, POSITIVE_INT, UNIT, Checked, OptionsError, Rule, at_least, one_of, ranged
from rfedray.task import ClientData, EvalData


@dataclass
class Options(Checked):
    """Schema of ``data.options`` for ``data.source: synthetic_pca``."""

    d: int = ranged(40, at_least(2))
    p: int = 4
    records_per_client: int = ranged(2000, POSITIVE_INT)
    size_spread: float = ranged(0.0, UNIT)
    heterogeneity: float = ranged(0.1, NON_NEGATIVE)
    eigengap: float = ranged(1.0, Rule(lambda v: v > 0, "must be > 0"))
    noise_std: float = ranged(0.3, NON_NEGATIVE)
    radius: float = ranged(1.0, Rule(lambda v: v > 0 and np.isfinite(v), "must be finite and > 0"))
    dtype: str = ranged("float32", one_of(DTYPES))

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        OptionsError.check(1 <= self.p < self.d, f"{prefix}.p", self.p, f"must be between 1 and d-1 ({self.d - 1})")




def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(0x5CA,) + key))


class SyntheticPCA:
    """A federation of ``n_clients`` PCA clients (see the module docstring).

    Parameters
    ----------
    options : Options
    n_clients : int
    seed : int
        Seeds the common subspace, every client's perturbation, size and records.
    """

    def __init__(self, options: Options, *, n_clients: int, seed: int):
        self.options = options
        self.num_clients = n_clients
        self.seed = seed
        self.dtype = DTYPES[options.dtype]
        self.info = {"task": "pca", "d": options.d, "p": options.p, "dataset": "synthetic_pca", "dtype": options.dtype,
                     "record_shape": (options.d,)}
        self._check_fits(available_memory())

    def _check_fits(self, available: int) -> None:
        """Refuse, before anything is allocated, a federation that this machine's memory cannot hold.

        A process that builds a client or evaluates holds ``d x d`` float64 matrices (a client's
        covariance factor, the pooled covariance); over a run every client's records are built.
        """
        o = self.options
        matrices = 2 * 8 * o.d * (o.d + o.p)
        records = o.records_per_client * (1 + o.size_spread) * self.num_clients * o.d * self.dtype.itemsize
        gib = 2**30
        if matrices > available:
            raise OptionsError("data.options.d", o.d, f"needs about {matrices / gib:.1f} GiB of memory (d x d float64 "
                              f"matrices), this machine has {available / gib:.1f} GiB available; lower data.options.d")
        if matrices + records > available:
            raise ConfigError("federation.n_clients", self.num_clients,
                              f"with data.options.records_per_client={o.records_per_client} and d={o.d} the clients' records "
                              f"need about {records / gib:.1f} GiB of memory, this machine has {available / gib:.1f} GiB "
                              "available; lower federation.n_clients or data.options.records_per_client")

    def _basis(self) -> np.ndarray:
        o = self.options
        q, _ = np.linalg.qr(_rng(self.seed, 0).standard_normal((o.d, o.p)))
        return q

    def client_sizes(self) -> list[int]:
        o = self.options
        if o.size_spread == 0.0:
            return [o.records_per_client] * self.num_clients
        rng = _rng(self.seed, 1)
        lo = max(1, int(round(o.records_per_client * (1 - o.size_spread))))
        hi = int(round(o.records_per_client * (1 + o.size_spread)))
        return [int(v) for v in rng.integers(lo, hi + 1, size=self.num_clients)]

    def _client_covariance_factor(self, client_id: int) -> np.ndarray:
        """``A_i`` with ``Sigma_i = A_i A_i^T``, shape (d, d)."""
        o = self.options
        rng = _rng(self.seed, 2, client_id)
        perturbed = self._basis() + o.heterogeneity * rng.standard_normal((o.d, o.p)) / np.sqrt(o.d)
        u, _, vt = np.linalg.svd(perturbed, full_matrices=False)
        basis = u @ vt
        spectrum = o.eigengap * (1.0 + np.arange(o.p)[::-1] / max(o.p, 1))
        return np.concatenate([basis * np.sqrt(spectrum), o.noise_std * np.eye(o.d)], axis=1)

    def _records(self, client_id: int) -> np.ndarray:
        o = self.options
        m = self.client_sizes()[client_id]
        rng = _rng(self.seed, 3, client_id)
        factor = self._client_covariance_factor(client_id)
        z = rng.standard_normal((m, factor.shape[1])) @ factor.T
        return o.radius * z / np.linalg.norm(z, axis=1, keepdims=True)

    def client_data(self, client_id: int) -> ClientData:
        if not (0 <= client_id < self.num_clients):
            raise ValueError(f"client_id={client_id}: must be in [0, {self.num_clients - 1}]")
        return ClientData(train=(torch.as_tensor(self._records(client_id), dtype=self.dtype),))

    @cached_property
    def pooled_covariance(self) -> np.ndarray:
        """Mean of ``z z^T`` over every training record of every client, shape (d, d)."""
        total = np.zeros((self.options.d, self.options.d))
        count = 0
        for i in range(self.num_clients):
            z = self._records(i)
            total += z.T @ z
            count += z.shape[0]
        return total / count

    def eval_data(self) -> EvalData:
        """The pooled covariance: a simulation oracle (it is computed from the training records)."""
        cov = torch.as_tensor(self.pooled_covariance, dtype=torch.float64)
        return EvalData(tensors=(cov,), oracle=True)


def build(options: Options, *, n_clients: int, seed: int) -> SyntheticPCA:
    return SyntheticPCA(options, n_clients=n_clients, seed=seed)
