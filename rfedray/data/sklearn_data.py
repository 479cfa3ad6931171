"""Tabular federated tasks from data shipped with scikit-learn, and a synthetic regression.

Three sources, all split over clients deterministically from ``(seed, client_id)``:

- ``digits``: scikit-learn's 8x8 handwritten digits (1,797 records, 64 features, 10 classes).
  Pixels are divided by 16 and every record is scaled to unit L2 norm (a per-record map, so it
  needs no pooled statistic and keeps per-record gradients of a GLM bounded).
- ``diabetes``: scikit-learn's diabetes regression (442 records, 10 features). The features ship
  already centred and scaled by scikit-learn; the target is standardised with the pooled training
  mean and standard deviation. That standardisation reads the pooled targets and is a
  preprocessing assumption outside the DP guarantee (two public constants in a deployment).
- ``synthetic_regression``: ``y = x^T w* + b* + noise`` with ``x ~ N(0, I_d / d)``; the
  population optimum of the squared loss is ``(w*, b*)``, exported as ``EvalData.extra["optimum"]``.
- ``synthetic_logistic``: binary labels from a logistic model on Gaussian features, for
  M-estimation with many records per client.

Records of the real datasets are first split into a pooled train and a pooled test part
(``test_fraction``); the train part is partitioned over clients, IID or with Dirichlet label skew
(classification) so that clients are heterogeneous, and the test part is what the server evaluates
on. :class:`ArrayFederation` is the generic holder that :mod:`rfedray.data.vision` reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Callable, Optional

import numpy as np
import torch

from rfedray.options import DTYPES, NON_NEGATIVE, OPEN_UNIT, POSITIVE_INT, POSITIVE_NUMBER, Checked, one_of, ranged
from rfedray.task import ClientData, EvalData

PARTITIONS = ("iid", "dirichlet")


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(0x5C1,) + key))


def split_train_test(n: int, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random permutation of ``range(n)`` cut into train and test indices."""
    order = rng.permutation(n)
    n_test = int(round(n * test_fraction))
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def partition_indices(
    n_records: int, n_clients: int, rng: np.random.Generator, *, labels: Optional[np.ndarray] = None,
    scheme: str = "iid", alpha: float = 0.5, min_records: int = 1,
) -> list[np.ndarray]:
    """Indices of every client's records.

    Parameters
    ----------
    n_records, n_clients : int
    rng : numpy Generator
    labels : array of int, optional
        Needed by ``scheme="dirichlet"``.
    scheme : {"iid", "dirichlet"}
        ``iid``: a random equal split. ``dirichlet``: for each class, the shares of the clients
        are drawn from ``Dirichlet(alpha)`` (smaller alpha, more label skew).
    alpha : float
        Concentration of the Dirichlet split, > 0.
    min_records : int
        Every client gets at least this many records (redrawn up to 100 times, then moved
        from the largest clients).

    Returns
    -------
    list of ndarray
        ``n_clients`` sorted index arrays that partition ``range(n_records)``.
    """
    if n_clients < 1 or n_clients * min_records > n_records:
        raise ValueError(f"n_clients={n_clients}: must be between 1 and {n_records // max(min_records, 1)} "
                         f"for {n_records} records and at least {min_records} per client")
    if scheme == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(n_records), n_clients)]
    if scheme != "dirichlet":
        raise ValueError(f"scheme={scheme!r}: must be one of {', '.join(PARTITIONS)}")
    if labels is None:
        raise ValueError("labels=None: the dirichlet partition needs class labels")
    if not alpha > 0:
        raise ValueError(f"alpha={alpha}: must be > 0")
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for cls in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_records:
            break
    while min(len(p) for p in parts) < min_records:
        small = min(range(n_clients), key=lambda i: len(parts[i]))
        large = max(range(n_clients), key=lambda i: len(parts[i]))
        parts[small].append(parts[large].pop())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


@dataclass
class Arrays:
    """A pooled dataset: training and test features and targets (numpy)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    task: str
    num_classes: Optional[int] = None
    extra: Optional[dict] = None


class ArrayFederation:
    """A :class:`rfedray.task.FederatedDataset` over in-memory arrays, partitioned over clients.

    The arrays come from ``loader`` (called once per process, lazily), so a process hosting a
    client rebuilds the same partition from the same arguments: records never travel.

    Parameters
    ----------
    loader : callable returning Arrays
    n_clients : int
    seed : int
    name : str
        Dataset name written to ``info``.
    partition : {"iid", "dirichlet"}
    alpha : float
    dtype : {"float32", "float64"}
    min_records : int
    """

    def __init__(self, loader: Callable[[], Arrays], *, n_clients: int, seed: int, name: str,
                 partition: str = "iid", alpha: float = 0.5, dtype: str = "float64", min_records: int = 1):
        if partition not in PARTITIONS:
            raise ValueError(f"partition={partition!r}: must be one of {', '.join(PARTITIONS)}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
        self._loader = loader
        self.num_clients = n_clients
        self.seed = seed
        self.partition = partition
        self.alpha = alpha
        self.dtype = DTYPES[dtype]
        self.min_records = min_records
        self._name = name
        self._dtype_name = dtype

    @cached_property
    def arrays(self) -> Arrays:
        return self._loader()

    @property
    def info(self) -> dict:
        a = self.arrays
        return {"task": a.task, "dataset": self._name, "num_features": int(a.x_train.shape[1]),
                "record_shape": (int(a.x_train.shape[1]),), "num_classes": a.num_classes, "dtype": self._dtype_name}

    @cached_property
    def _parts(self) -> list[np.ndarray]:
        a = self.arrays
        labels = a.y_train if a.task == "classification" else None
        scheme = self.partition if labels is not None else "iid"
        return partition_indices(len(a.x_train), self.num_clients, _rng(self.seed, 1), labels=labels,
                                 scheme=scheme, alpha=self.alpha, min_records=self.min_records)

    def _target(self, y: np.ndarray) -> torch.Tensor:
        if self.arrays.task == "classification":
            return torch.as_tensor(y, dtype=torch.int64)
        return torch.as_tensor(y, dtype=self.dtype)

    def client_sizes(self) -> list[int]:
        return [len(p) for p in self._parts]

    def client_data(self, client_id: int) -> ClientData:
        if not (0 <= client_id < self.num_clients):
            raise ValueError(f"client_id={client_id}: must be in [0, {self.num_clients - 1}]")
        idx = self._parts[client_id]
        a = self.arrays
        return ClientData(train=(torch.as_tensor(a.x_train[idx], dtype=self.dtype), self._target(a.y_train[idx])))

    def pooled_train(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's training records together (a simulation oracle, for reference estimators)."""
        a = self.arrays
        return torch.as_tensor(a.x_train, dtype=self.dtype), self._target(a.y_train)

    def eval_data(self) -> EvalData:
        a = self.arrays
        x = torch.as_tensor(a.x_test, dtype=self.dtype)
        extra = dict(a.extra or {})
        return EvalData(tensors=(x, self._target(a.y_test)), oracle=bool(extra.get("oracle", False)), extra=extra)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def load_digits_arrays(seed: int, test_fraction: float) -> Arrays:
    """scikit-learn's digits, pixels / 16, records scaled to unit norm, split train/test."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = _unit_rows(bunch.data.astype(np.float64) / 16.0)
    y = bunch.target.astype(np.int64)
    tr, te = split_train_test(len(x), test_fraction, _rng(seed, 0))
    return Arrays(x[tr], y[tr], x[te], y[te], "classification", 10)


def load_diabetes_arrays(seed: int, test_fraction: float) -> Arrays:
    """scikit-learn's diabetes (scaled features), target standardised on the pooled training part."""
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    x = bunch.data.astype(np.float64)
    y = bunch.target.astype(np.float64)
    tr, te = split_train_test(len(x), test_fraction, _rng(seed, 0))
    mean, std = y[tr].mean(), y[tr].std()
    return Arrays(x[tr], (y[tr] - mean) / std, x[te], (y[te] - mean) / std, "regression",
                  extra={"target_mean": float(mean), "target_std": float(std)})


def synthetic_regression_arrays(seed: int, n_train: int, n_test: int, d: int, noise_std: float) -> Arrays:
    """``y = x^T w* + b* + eps``, ``x ~ N(0, I/d)``, ``eps ~ N(0, noise_std^2)``; optimum ``(w*, b*)``."""
    rng = _rng(seed, 2)
    w = rng.standard_normal(d)
    w /= np.linalg.norm(w)
    b = 0.5
    x = rng.standard_normal((n_train + n_test, d)) / np.sqrt(d)
    y = x @ w + b + noise_std * rng.standard_normal(n_train + n_test)
    optimum = {"weight": w[None, :].copy(), "bias": np.array([b])}
    return Arrays(x[:n_train], y[:n_train], x[n_train:], y[n_train:], "regression",
                  extra={"optimum": optimum, "noise_std": noise_std})


def synthetic_logistic_arrays(seed: int, n_train: int, n_test: int, d: int) -> Arrays:
    """Binary labels with ``P(y = 1 | x) = sigmoid(x^T w* + b*)``, ``x ~ N(0, I/d)``, ``||w*|| = 3``.

    As a two-class softmax model the data-generating parameters are identified only up to a shift
    shared by the classes, so the study measures errors against the pooled M-estimator instead.
    """
    rng = _rng(seed, 4)
    w = rng.standard_normal(d)
    w *= 3.0 / np.linalg.norm(w)
    x = rng.standard_normal((n_train + n_test, d)) / np.sqrt(d)
    p = 1.0 / (1.0 + np.exp(-(x @ w + 0.25)))
    y = (rng.random(n_train + n_test) < p).astype(np.int64)
    return Arrays(x[:n_train], y[:n_train], x[n_train:], y[n_train:], "classification", 2)


LOADERS: dict[str, Callable[[Any, int, int], Callable[[], Arrays]]] = {
    "digits": lambda o, n_clients, seed: partial(load_digits_arrays, seed, o.test_fraction),
    "diabetes": lambda o, n_clients, seed: partial(load_diabetes_arrays, seed, o.test_fraction),
    "synthetic_regression": lambda o, n_clients, seed: partial(
        synthetic_regression_arrays, seed, o.records_per_client * n_clients, o.test_records, o.d, o.noise_std),
    "synthetic_logistic": lambda o, n_clients, seed: partial(
        synthetic_logistic_arrays, seed, o.records_per_client * n_clients, o.test_records, o.d),
}
"""Dataset name -> ``(options, n_clients, seed) -> loader``: the loader makes the pooled arrays
(training and test) that :class:`ArrayFederation` partitions."""


@dataclass
class Options(Checked):
    """Schema of ``data.options`` for the scikit-learn sources.

    Attributes
    ----------
    dataset : {"digits", "diabetes", "synthetic_regression"}
    partition : {"iid", "dirichlet"}
        Split of the training records over clients (dirichlet: label skew, classification only).
    alpha : float
        Dirichlet concentration (smaller: more heterogeneous clients).
    test_fraction : float
        Share of the real datasets held out for the server's evaluation.
    records_per_client : int
        Synthetic sources only: training records of each client.
    test_records : int
        Synthetic sources only: size of the test set.
    d : int
        Synthetic sources only: number of features.
    noise_std : float
        Synthetic regression only: standard deviation of the label noise.
    dtype : {"float32", "float64"}
    """

    dataset: str = ranged("digits", one_of(LOADERS))
    partition: str = ranged("iid", one_of(PARTITIONS))
    alpha: float = ranged(0.5, POSITIVE_NUMBER)
    test_fraction: float = ranged(0.2, OPEN_UNIT)
    records_per_client: int = ranged(500, POSITIVE_INT)
    test_records: int = ranged(2000, POSITIVE_INT)
    d: int = ranged(10, POSITIVE_INT)
    noise_std: float = ranged(0.1, NON_NEGATIVE)
    dtype: str = ranged("float64", one_of(DTYPES))


def build(options: Options, *, n_clients: int, seed: int) -> ArrayFederation:
    """The federation described by ``options`` (validated first)."""
    options.validate("data.options")
    o = options
    loader = LOADERS[o.dataset](o, n_clients, seed)
    return ArrayFederation(loader, n_clients=n_clients, seed=seed, name=o.dataset, partition=o.partition,
                           alpha=o.alpha, dtype=o.dtype)
