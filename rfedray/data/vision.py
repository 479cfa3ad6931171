"""MNIST and CIFAR-10 from their standard files in a local cache directory (never downloaded).

torchvision is not a dependency (its wheels do not match this torch), so the two standard formats
are read directly:

- MNIST: the four IDX files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (optionally ``.gz``), looked for in
  ``ROOT``, ``ROOT/mnist``, ``ROOT/MNIST/raw`` (torchvision's layout);
- CIFAR-10: the python pickles ``data_batch_1`` ... ``data_batch_5`` and ``test_batch`` in
  ``ROOT/cifar-10-batches-py`` (the extracted ``cifar-10-python.tar.gz``).

``ROOT`` is ``data.options.root``, else :func:`rfedray.paths.data_dir` (``$RFEDRAY_DATA_DIR``, else the
platform's user data folder, ``~/.local/share/rfedray`` on Linux).
Pixels are scaled to [0, 1], flattened, and (by default) each record is scaled to unit L2 norm,
which bounds the per-record gradients of a GLM. The official train split is partitioned over the
clients; the official test split is what the server evaluates on.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np

from rfedray.data.sklearn_data import PARTITIONS, ArrayFederation, Arrays, _rng, _unit_rows
from rfedray.errors import RfedrayError
from rfedray.options import DTYPES, POSITIVE_NUMBER, Checked, Rule, one_of, ranged
from rfedray.paths import data_dir

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
DATASETS = ("mnist", "cifar10")
SUBSET = Rule(lambda v: v >= 1, "must be null (all) or an integer >= 1")
"""A random subset's size (``max_train_records``, ``max_test_records``)."""
FETCH_HINT = {
    "mnist": "download the four MNIST IDX files (e.g. from the MNIST page of Yann LeCun or a mirror) "
             "into that directory; .gz files are read as they are",
    "cifar10": "download cifar-10-python.tar.gz (University of Toronto CIFAR page) and extract it there, "
               f"so that {CIFAR_DIR}/ holds data_batch_1..5 and test_batch",
}


class DatasetNotFoundError(RfedrayError):
    """A dataset's files are not in the cache directory (rfedray never downloads them)."""

    def __init__(self, dataset: str, searched: list[Path], missing: str):
        places = ", ".join(str(p) for p in searched)
        super().__init__(
            f"dataset {dataset!r}: {missing} not found (looked in {places}); {FETCH_HINT[dataset]}, "
            "or point data.options.root (or $RFEDRAY_DATA_DIR) at a directory that has them"
        )


def default_root(root: Optional[str] = None) -> Path:
    """The data directory: ``root``, else :func:`rfedray.paths.data_dir`."""
    return Path(root).expanduser() if root else data_dir()


def read_idx(path: Path) -> np.ndarray:
    """An IDX array (unsigned bytes, any number of dimensions), gzip-compressed or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise RfedrayError(f"{path}: not an IDX file of unsigned bytes (bad magic number)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise RfedrayError(f"{path}: truncated IDX file ({data.size} values for shape {tuple(dims)})")
    return data.reshape(dims)


def _find_mnist(root: Path) -> dict[str, Path]:
    places = [root, root / "mnist", root / "MNIST" / "raw"]
    for place in places:
        found = {}
        for key, name in MNIST_FILES.items():
            for candidate in (place / name, place / f"{name}.gz"):
                if candidate.is_file():
                    found[key] = candidate
                    break
        if len(found) == len(MNIST_FILES):
            return found
    raise DatasetNotFoundError("mnist", places, "the IDX files " + ", ".join(MNIST_FILES.values()))


def load_mnist(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` with images of shape (n, 28, 28), uint8."""
    files = _find_mnist(root)
    return tuple(read_idx(files[k]) for k in ("train_images", "train_labels", "test_images", "test_labels"))  # type: ignore[return-value]


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as fh:
        batch = pickle.load(fh, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return data, np.asarray(batch[b"labels"], dtype=np.int64)


def load_cifar10(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` with images of shape (n, 3, 32, 32), uint8."""
    folder = root / CIFAR_DIR
    missing = [n for n in (*CIFAR_TRAIN, CIFAR_TEST) if not (folder / n).is_file()]
    if missing:
        raise DatasetNotFoundError("cifar10", [folder], "the pickled batches " + ", ".join(missing))
    parts = [_cifar_batch(folder / n) for n in CIFAR_TRAIN]
    x_test, y_test = _cifar_batch(folder / CIFAR_TEST)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test


LOADERS = {"mnist": load_mnist, "cifar10": load_cifar10}


def vision_arrays(dataset: str, root: Path, unit_norm: bool, max_train: Optional[int], max_test: Optional[int],
                  seed: int) -> Arrays:
    """Flattened, [0, 1]-scaled (and optionally unit-norm) arrays, optionally subsampled."""
    x_tr, y_tr, x_te, y_te = LOADERS[dataset](root)
    rng = _rng(seed, 3)
    if max_train is not None and max_train < len(x_tr):
        keep = np.sort(rng.choice(len(x_tr), max_train, replace=False))
        x_tr, y_tr = x_tr[keep], y_tr[keep]
    if max_test is not None and max_test < len(x_te):
        keep = np.sort(rng.choice(len(x_te), max_test, replace=False))
        x_te, y_te = x_te[keep], y_te[keep]

    def features(x: np.ndarray) -> np.ndarray:
        flat = x.reshape(len(x), -1).astype(np.float64) / 255.0
        return _unit_rows(flat) if unit_norm else flat

    return Arrays(features(x_tr), y_tr.astype(np.int64), features(x_te), y_te.astype(np.int64), "classification", 10)


@dataclass
class Options(Checked):
    """Schema of ``data.options`` for ``mnist`` / ``cifar10``.

    Attributes
    ----------
    dataset : {"mnist", "cifar10"}
    root : str or None
        Cache directory holding the files (see the module docstring); never downloaded into.
    partition : {"iid", "dirichlet"}
    alpha : float
    unit_norm : bool
        Scale every record to unit L2 norm.
    max_train_records, max_test_records : int or None
        Random subsets, for quick runs.
    dtype : {"float32", "float64"}
    """

    dataset: str = ranged("mnist", one_of(DATASETS))
    root: Optional[str] = None
    partition: str = ranged("iid", one_of(PARTITIONS))
    alpha: float = ranged(0.5, POSITIVE_NUMBER)
    unit_norm: bool = True
    max_train_records: Optional[int] = ranged(None, SUBSET)
    max_test_records: Optional[int] = ranged(None, SUBSET)
    dtype: str = ranged("float32", one_of(DTYPES))


def build(options: Options, *, n_clients: int, seed: int) -> ArrayFederation:
    """The federation over the official train split; files are read when first needed."""
    options.validate("data.options")
    o = options
    loader = partial(vision_arrays, o.dataset, default_root(o.root), o.unit_norm, o.max_train_records,
                     o.max_test_records, seed)
    return ArrayFederation(loader, n_clients=n_clients, seed=seed, name=o.dataset, partition=o.partition,
                           alpha=o.alpha, dtype=o.dtype)
