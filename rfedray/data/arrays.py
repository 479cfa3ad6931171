"""A federation from your own arrays: every client's records in one ``.npz`` file.

Write the file with :func:`numpy.savez` (``data.options.path``), for clients ``i = 0 .. n-1``
(``n = federation.n_clients``):

==========  ====================  ==========================================================
key         shape                 content
==========  ====================  ==========================================================
``x_<i>``   ``(m_i, *record)``    client i's training records, real numbers
``y_<i>``   ``(m_i,)``            their labels (``classification``: integers in [0, K)) or
                                  targets (``regression``); absent for ``pca``
``x_test``  ``(n_test, *record)`` the server's held-out evaluation records (never trained on)
``y_test``  ``(n_test,)``         their labels or targets; absent for ``pca``
==========  ====================  ==========================================================

``record`` is ``(d,)`` for ``representation: vector`` (models ``fedpca``, ``logreg``, ``mlp``),
``(C, C)`` symmetric positive definite matrices for ``covariance`` (``spdnet``) and ``(C, T)``
for ``raw`` (``eegnet``). ``task: pca`` evaluates the model on the covariance ``mean(z z^T)`` of
``x_test``; the other tasks on ``(x_test, y_test)``.

The whole file is checked when the source is built, before anything trains: it must be a
readable ``.npz`` without pickled objects, hold exactly the federation's clients, and every array
must have the layout above and a real numeric dtype; every record must be finite (covariances
also symmetric positive definite) and every label an integer in ``[0, num_classes)``. The first
problem raises a :class:`~rfedray.options.OptionsError` naming ``data.options.path``, the array,
the record and what to do. Each process that hosts clients (a Ray client actor) reads the file
itself, so the path must be readable there too.

The file is checked once per content, not once per process: a check that passes leaves its verdict
(the record counts and the ``info`` the check derived, public facts of the federation) in
``<cache_dir>/arrays/`` (:func:`rfedray.paths.cache_dir`) under the SHA-256 of the file's bytes and
of the options the check depends on, and another process (a client actor, the next run) that finds
the verdict of the same bytes and options takes it instead of checking every record again. A file
whose bytes changed has another digest, so it is checked again; a failing check leaves nothing.

The check reads one array at a time and keeps only the record counts: a client's arrays are read from
the file again when its data is loaded (:meth:`ArraysFederation.client_data`, through one open
archive per process), so the processes of a run share the file through the operating system's cache
instead of each holding every client's records. A file that changed after the check (another size or
modification time) is refused then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from rfedray.errors import RfedrayError
from rfedray.options import DTYPES, OptionsError
from rfedray.paths import cache_dir
from rfedray.data.validation import first_nonfinite, spd_problem
from rfedray.task import ClientData, EvalData

log = logging.getLogger(__name__)

KEY = re.compile(r"^(x|y)_(\d+|test)$")
VERDICT_FORMAT = 1
"""Version of the verdicts this module writes; part of their digest, so an older one is never read."""


class Records:
    """What one record is: its rank, the ``info`` it gives models, its checks (none by default)."""

    ndim = 1
    layout = "(m, d)"

    @staticmethod
    def info(shape: tuple[int, ...]) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def shape_problem(shape: tuple[int, ...]) -> Optional[str]:
        return None

    @staticmethod
    def problem(x: np.ndarray) -> Optional[str]:
        return None


class VectorRecords(Records):
    """Records are vectors ``(d,)``."""

    @staticmethod
    def info(shape: tuple[int, ...]) -> dict[str, Any]:
        return {"d": shape[0], "num_features": shape[0], "record_shape": shape}


class CovarianceRecords(Records):
    """Records are symmetric positive definite matrices ``(C, C)`` (SPDNet's input)."""

    ndim = 2
    layout = "(m, C, C)"

    @staticmethod
    def info(shape: tuple[int, ...]) -> dict[str, Any]:
        return {"channels": shape[0], "representation": "covariance", "record_shape": shape}

    @staticmethod
    def shape_problem(shape: tuple[int, ...]) -> Optional[str]:
        return None if shape[0] == shape[1] else "covariances are square (C, C) matrices"

    @staticmethod
    def problem(x: np.ndarray) -> Optional[str]:
        return spd_problem(x)


class RawRecords(Records):
    """Records are multichannel signals ``(C, T)`` (EEGNet's input)."""

    ndim = 2
    layout = "(m, C, T)"

    @staticmethod
    def info(shape: tuple[int, ...]) -> dict[str, Any]:
        return {"channels": shape[0], "n_times": shape[1], "representation": "raw", "record_shape": shape}


REPRESENTATIONS = {"vector": VectorRecords, "covariance": CovarianceRecords, "raw": RawRecords}


class PCATask:
    """Unlabelled records; the server evaluates on the covariance of ``x_test``."""

    labelled = False
    representations = ("vector",)

    @staticmethod
    def info(options: "Options", shape: tuple[int, ...], labels: list[np.ndarray]) -> dict[str, Any]:
        if not 1 <= options.p < shape[0]:
            raise OptionsError("data.options.p", options.p, f"must be between 1 and d-1 ({shape[0] - 1})")
        return {"p": options.p}

    @staticmethod
    def eval_tensors(x: torch.Tensor, y: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x64 = x.to(torch.float64)
        return (x64.T @ x64 / x64.shape[0],)


class LabelledTask:
    """One label or target per record; the server evaluates on ``(x_test, y_test)``."""

    labelled = True

    @staticmethod
    def eval_tensors(x: torch.Tensor, y: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (x, y)


class ClassificationTask(LabelledTask):
    """Integer labels in ``[0, num_classes)``."""

    representations = tuple(REPRESENTATIONS)

    @staticmethod
    def info(options: "Options", shape: tuple[int, ...], labels: list[np.ndarray]) -> dict[str, Any]:
        """``num_classes``: the option, else 1 + the largest integer label (at least 2)."""
        if options.num_classes is not None:
            return {"num_classes": options.num_classes}
        largest = max((int(y.max()) for y in labels if y.dtype.kind in "iu" and y.size), default=1)
        return {"num_classes": max(2, largest + 1)}

    @staticmethod
    def check_labels(y: np.ndarray, info: dict[str, Any]) -> Optional[str]:
        if y.dtype.kind not in "iu":
            return f"has dtype {y.dtype}; class labels must be integers"
        num_classes = info["num_classes"]
        bad = np.flatnonzero((y < 0) | (y >= num_classes))
        if bad.size:
            i = int(bad[0])
            return f"record {i} has a label outside [0, {num_classes}) (data.options.num_classes={num_classes})"
        return None

    @staticmethod
    def target(y: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(y, dtype=torch.int64)


class RegressionTask(LabelledTask):
    """Real, finite targets."""

    representations = ("vector",)

    @staticmethod
    def info(options: "Options", shape: tuple[int, ...], labels: list[np.ndarray]) -> dict[str, Any]:
        return {}

    @staticmethod
    def check_labels(y: np.ndarray, info: dict[str, Any]) -> Optional[str]:
        if y.dtype.kind not in "fiu":
            return f"has dtype {y.dtype}; regression targets must be real numbers"
        return first_nonfinite(y.reshape(-1, 1))

    @staticmethod
    def target(y: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(y, dtype=dtype)


TASKS = {"pca": PCATask, "classification": ClassificationTask, "regression": RegressionTask}


@dataclass
class Options:
    """Schema of ``data.options`` for ``data.source: arrays``.

    Attributes
    ----------
    path : str
        The ``.npz`` file (see the module docstring for its layout).
    task : str
        ``pca``, ``classification`` or ``regression``.
    representation : str
        ``vector``, ``covariance`` or ``raw``: what one record is.
    num_classes : int or None
        Classification only: ``K``; ``None`` takes 1 + the largest label in the file.
    p : int
        PCA only: the subspace dimension ``fedpca`` estimates unless ``model.options.p`` is set.
    dtype : str
        ``float32`` or ``float64``: the records' dtype in training.
    """

    path: str = ""
    task: str = "pca"
    representation: str = "vector"
    num_classes: Optional[int] = None
    p: int = 1
    dtype: str = "float32"

    def validate(self, prefix: str) -> None:
        OptionsError.check(self.path, f"{prefix}.path", self.path, "give the .npz file of the clients' arrays")
        if not Path(self.path).expanduser().is_file():
            raise OptionsError(f"{prefix}.path", self.path, "no such file; give the .npz file of the clients' arrays")
        OptionsError.one_of(f"{prefix}.task", self.task, TASKS)
        if self.representation not in TASKS[self.task].representations:
            raise OptionsError(f"{prefix}.representation", self.representation,
                              f"task {self.task} takes " + ", ".join(TASKS[self.task].representations))
        if self.num_classes is not None and self.num_classes < 2:
            raise OptionsError(f"{prefix}.num_classes", self.num_classes, "must be null (from the labels) or an integer >= 2")
        OptionsError.check(self.p >= 1, f"{prefix}.p", self.p, "must be an integer >= 1")
        OptionsError.one_of(f"{prefix}.dtype", self.dtype, DTYPES)


class FileArrays:
    """The arrays of an open ``.npz``, read one at a time (``key in``, ``[key]``, iteration over the
    keys), with a clear error for an array that cannot be read."""

    def __init__(self, archive: np.lib.npyio.NpzFile, source: "ArraysFederation"):
        self.archive, self.source = archive, source

    def __iter__(self) -> Iterator[str]:
        return iter(self.archive.files)

    def __contains__(self, key: str) -> bool:
        return key in self.archive.files

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            return self.archive[key]
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise self.source._fail(f"array {key!r} cannot be read ({type(exc).__name__}); "
                                    "store plain numeric arrays (no Python objects)") from None


class ArraysFederation:
    """The clients of an ``.npz`` file (implements :class:`rfedray.task.FederatedDataset`).

    Parameters
    ----------
    options : Options
    n_clients : int
        The file must hold exactly this many clients.

    Raises
    ------
    OptionsError
        For the first problem of the file (see the module docstring).
    """

    def __init__(self, options: Options, *, n_clients: int):
        options.validate("data.options")
        self.options = options
        self.num_clients = n_clients
        self.path = str(Path(options.path).expanduser())
        self.task = TASKS[options.task]
        self.records = REPRESENTATIONS[options.representation]
        self.dtype = DTYPES[options.dtype]
        self._stamp = self._file_stamp()
        self._archive: Optional[np.lib.npyio.NpzFile] = None  # opened by the first load of a client's arrays
        digest = self._digest()
        verdict = self._read_verdict(digest)
        if verdict is None:
            with self._open() as archive:
                verdict = self._check(FileArrays(archive, self))
            self._write_verdict(digest, verdict)
        self._sizes, shape, derived = verdict
        self.info = {"task": self.options.task, "dataset": "arrays", "dtype": self.options.dtype,
                     **self.records.info(shape), **derived}

    def _fail(self, problem: str) -> OptionsError:
        return OptionsError("data.options.path", self.path, problem)

    def _file_stamp(self) -> tuple[int, int]:
        stat = os.stat(self.path)
        return stat.st_size, stat.st_mtime_ns

    def _digest(self) -> Optional[str]:
        """SHA-256 of the file's bytes and of what the check depends on (the options but the path,
        the number of clients, :data:`VERDICT_FORMAT`), hex; None when the file cannot be read (the
        check then says why)."""
        o = self.options
        h = hashlib.sha256(json.dumps([VERDICT_FORMAT, self.num_clients, o.task, o.representation, o.num_classes,
                                       o.p, o.dtype]).encode())
        try:
            with open(self.path, "rb") as fh:
                while block := fh.read(1 << 22):
                    h.update(block)
        except OSError:
            return None
        return h.hexdigest()

    @staticmethod
    def _verdict_path(digest: str) -> Path:
        return cache_dir() / "arrays" / f"{digest}.json"

    def _read_verdict(self, digest: Optional[str]) -> Optional[tuple[list[int], tuple[int, ...], dict[str, Any]]]:
        """The verdict of an earlier check of these bytes and options, or None (none, or unreadable)."""
        if digest is None:
            return None
        try:
            saved = json.loads(self._verdict_path(digest).read_text())
            return [int(m) for m in saved["sizes"]], tuple(int(s) for s in saved["shape"]), dict(saved["derived"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_verdict(self, digest: Optional[str], verdict: tuple[list[int], tuple[int, ...], dict[str, Any]]) -> None:
        """Keep a passed check's verdict for the next process (atomically; a cache that cannot be
        written only means the next process checks again). Nothing is kept when the file changed
        while it was hashed and checked."""
        if digest is None or self._file_stamp() != self._stamp:
            return
        sizes, shape, derived = verdict
        path = self._verdict_path(digest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"sizes": sizes, "shape": list(shape), "derived": derived}))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("the check's verdict of %s was not kept (%s)", self.path, exc)

    def _open(self) -> np.lib.npyio.NpzFile:
        """The file as an archive of arrays, refusing anything that is not a plain ``.npz`` of numbers."""
        try:
            archive = np.load(self.path, allow_pickle=False)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise self._fail(f"not a readable .npz file ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                             "write it with numpy.savez(path, x_0=..., x_1=..., x_test=...)") from None
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise self._fail("holds a single array; write every client's arrays with numpy.savez(path, x_0=..., x_1=..., x_test=...)")
        for key in archive.files:
            match = KEY.match(key)
            problem = None
            if not match:
                problem = f"unexpected array {key!r}; the file holds x_<i> and y_<i> per client i, x_test and y_test"
            elif match.group(2) != "test" and match.group(2) != str(int(match.group(2))):
                problem = (f"array {key!r}: client numbers are written without leading zeros "
                           f"({match.group(1)}_{int(match.group(2))}); rename it")
            if problem is not None:
                archive.close()
                raise self._fail(problem)
        return archive

    def _check(self, arrays: "FileArrays") -> tuple[list[int], tuple[int, ...], dict[str, Any]]:
        """Every client's record count, the shape of one record and the task's part of ``info``, each
        array checked as it is read."""
        clients = sorted({int(m.group(2)) for key in arrays if (m := KEY.match(key)) and m.group(2) != "test"})
        held = len(clients)
        if clients != list(range(held)) or held != self.num_clients:
            raise OptionsError(
                "federation.n_clients", self.num_clients,
                f"{self.path} holds clients {clients} (arrays x_<i>); it must hold exactly x_0 .. "
                f"x_{self.num_clients - 1}: set federation.n_clients={held} or rewrite the file",
            )
        names: list[Any] = [*range(held), "test"]
        shapes: dict[Any, tuple[int, ...]] = {}
        for name in names:
            shapes[name] = self._check_records(arrays, name, shapes.get(0))
        shape = shapes[0][1:]
        labels = [arrays[f"y_{name}"] for name in names if f"y_{name}" in arrays]
        derived = self.task.info(self.options, shape, labels)
        for name in names:
            self._check_labels(arrays, name, shapes[name][0], derived)
        return [shapes[i][0] for i in range(held)], shape, derived

    def _check_records(self, arrays: "FileArrays", name: Any, first: Optional[tuple[int, ...]]) -> tuple[int, ...]:
        key = f"x_{name}"
        where = f"client {name}" if name != "test" else "the server's evaluation set"
        if key not in arrays:
            raise self._fail(f"has no array {key!r} ({where}'s records)")
        x = arrays[key]
        if x.dtype.kind not in "fiu":
            raise self._fail(f"{key} has dtype {x.dtype}; records must be real numbers (float or integer arrays)")
        expected = self.records.layout
        if x.ndim != 1 + self.records.ndim:
            raise self._fail(f"{key} has shape {x.shape}; data.options.representation={self.options.representation} expects {expected}")
        shape_problem = self.records.shape_problem(x.shape[1:])
        if shape_problem is not None:
            raise self._fail(f"{key} holds records of shape {x.shape[1:]}; {shape_problem}")
        if x.shape[0] == 0:
            raise self._fail(f"{key} has no records: every client needs at least federation.batch_size records "
                             "(drop the client from the file and lower federation.n_clients)")
        if first is not None and x.shape[1:] != first[1:]:
            raise self._fail(f"{key} holds records of shape {x.shape[1:]}, x_0 of shape {first[1:]}: "
                             "every record of every client must have the same shape")
        with np.errstate(over="ignore", invalid="ignore"):  # the check below names what overflows
            trained = x.astype(np.dtype(self.options.dtype), copy=False)
        problem = first_nonfinite(trained) or self.records.problem(x)
        if problem is not None and first_nonfinite(x) is None:
            problem += f" as {self.options.dtype} (data.options.dtype, the dtype it trains in)"
        if problem is not None:
            raise self._fail(f"{key} ({where}): {problem}; repair or remove that record")
        return tuple(int(s) for s in x.shape)

    def _check_labels(self, arrays: "FileArrays", name: Any, m: int, info: dict[str, Any]) -> None:
        key = f"y_{name}"
        if not self.task.labelled:
            if key in arrays:
                raise self._fail(f"holds {key}, but data.options.task={self.options.task} takes no labels: "
                                 "remove the y_ arrays or set data.options.task")
            return
        if key not in arrays:
            raise self._fail(f"has no array {key!r}; data.options.task={self.options.task} needs one label per record")
        y = arrays[key]
        if y.shape != (m,):
            raise self._fail(f"{key} has shape {y.shape}; expected ({m},), one label per record of x_{name}")
        problem = self.task.check_labels(y, info)
        if problem is not None:
            raise self._fail(f"{key}: {problem}; fix the labels or data.options.num_classes")

    def client_sizes(self) -> list[int]:
        return list(self._sizes)

    def _tensors(self, name: Any) -> tuple[torch.Tensor, ...]:
        """The arrays of client ``name`` (or ``"test"``), read from the file again.

        Raises
        ------
        RfedrayError
            If the file changed since it was checked.
        """
        if self._file_stamp() != self._stamp:
            raise RfedrayError(f"data.options.path={self.path}: the file changed after it was checked; "
                               "start the run again (the records of a run must not change while it runs)")
        if self._archive is None:
            self._archive = np.load(self.path, allow_pickle=False)
        x = torch.as_tensor(self._archive[f"x_{name}"], dtype=self.dtype)
        if not self.task.labelled:
            return (x,)
        return (x, self.task.target(self._archive[f"y_{name}"], self.dtype))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the open file (a process that unpickles it opens the file again)."""
        return {**self.__dict__, "_archive": None}

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client_id={client_id}: must be in [0, {self.num_clients - 1}]")
        return ClientData(train=self._tensors(client_id))

    def eval_data(self) -> EvalData:
        """The held-out ``x_test`` (and ``y_test``), never any client's training records."""
        tensors = self._tensors("test")
        return EvalData(tensors=self.task.eval_tensors(tensors[0], tensors[1] if len(tensors) > 1 else None))


def build(options: Options, *, n_clients: int, seed: int) -> ArraysFederation:
    """The federation of ``options.path`` (``seed`` is unused: the file fixes the partition)."""
    return ArraysFederation(options, n_clients=n_clients)
