"""EEG motor-imagery datasets from MOABB, partitioned over clients by subject.

Datasets (Table 5 of the paper; PhysionetMI is the one whose files are in ``shared/data``):

=============  ========  ===  ===  ======  ====================  =========  ====================
name           subjects  C    K    native  window after cue (s)  T at 128   MOABB paradigm
=============  ========  ===  ===  ======  ====================  =========  ====================
BNCI2014_001   9         22   4    250 Hz  2-6                   513        MotorImagery (4)
Weibo2014      10        60   7    200 Hz  3-7                   513        MotorImagery (7)
Cho2017        52        64   2    512 Hz  0-3                   384        LeftRightImagery
PhysionetMI    1-17 (*)  64   2    160 Hz  0-3                   384        LeftRightImagery
=============  ========  ===  ===  ======  ====================  =========  ====================

(*) PhysionetMI has 109 subjects; the default is the 17 of the offline copy in
``shared/data/eegmmidb`` (S001-S017, imagined left vs right fist, runs 4, 8 and 12 only: 45 cues a
subject, T1 = left fist, T2 = right fist, MOABB's ``left_hand`` and ``right_hand``). Its window is
MOABB's ``[0, 3]`` s after the cue (the cue lasts 4.1 s), cut to 384 samples at 128 Hz exactly as
Cho2017's.

Preprocessing, done by MOABB's paradigm: band-pass ``[fmin, fmax]`` (8-30 Hz by default),
resampling to ``resample`` Hz (128), epochs over the dataset's MOABB interval, in microvolts (MOABB's
``unit_factor``). Every trial is then cut to its first ``n_times`` samples, by default
``floor(window * resample) + endpoint`` (the paper's T: 513 = 4 s x 128 + 1 for BNCI2014_001 and
Weibo2014, 384 = 3 s x 128 for Cho2017), and turned into the model's input by a representation:

- ``covariance`` (:class:`CovarianceRepresentation`): a shrinkage covariance estimator of pyriemann
  (``oas`` by default, or ``lwf``, ``sch``), then each matrix is divided by its mean eigenvalue
  ``tr(S) / C``. Raw EEG covariances are ~1e-10 V^2 (~100 uV^2), so without this every eigenvalue
  would sit near or under SPDNet's ReEig floor eps_R (Table 5: 2e-5 to 8e-5); after it the
  eigenvalues average 1 and eps_R only clamps the near-null directions. The normalisation uses
  the trial alone, so one record's features never depend on another record (the record-level DP
  guarantee is untouched).
- ``raw`` (:class:`RawRepresentation`): the trial itself, shape ``(C, n_times)``, in microvolts.

Channels: every EEG channel of the dataset, or the ones named in ``channels`` (MOABB picks them
before epoching; e.g. the 21 sensorimotor channels FC5..FC6, C5..C6, CP5..CP6 of PhysionetMI).

Clients: the chosen subjects, in order, are cut into ``n_clients`` contiguous groups
(:func:`numpy.array_split`: 9 BNCI2014_001 subjects -> 3 clients of 3; 52 Cho2017 subjects -> 26 of
2; 10 Weibo2014 subjects -> 5 of 2; 17 PhysionetMI subjects -> 17 of 1 or 6 of 3, 3, 3, 3, 3, 2).
Every subject's trials are split into train and test, stratified by class (``test_fraction`` of
each class, at random, seeded by ``(split_seed, subject)``), so the test set is the same however
the subjects are grouped; a client holds the training and test trials of its subjects. Each client
evaluates on its own test split and the server learns the secure-aggregated sum
(``run.test_set: clients``, :mod:`rfedray.federated.evaluation`): the metrics of the union of the
test splits, which :meth:`MOABBEEG.eval_data` loads in the server process for
``run.test_set: server``. For the hyperparameter search
(``evaluate_on: validation``) the test splits are set aside unseen and a validation split is cut
from each subject's training trials (seeded by ``run.seed``) and evaluated on instead
(:class:`Holdout`).

Cache: the preprocessed arrays of every subject are stored as ``.npz`` under
``<cache_dir>/<dataset>/<key>/`` (``cache_dir`` defaults to ``eeg`` in the user's cache folder,
:func:`rfedray.paths.cache_dir`), where ``key`` hashes every preprocessing parameter (dataset,
events, paradigm, band, sampling rate, n_times, representation and its estimator, the versions of
MOABB, MNE and pyriemann). Files are written atomically, so processes may share a cache.

Offline use: the data folder is ``data_path`` (option), else the environment variable MNE and
MOABB use (``MNE_DATASETS_<SIGN>_PATH``), else a default (PhysionetMI:
``<repository>/../shared/data/eegmmidb``; the others: MNE's ``MNE_DATA`` or ``~/mne_data``). A
dataset that is neither on disk nor downloadable raises :class:`DatasetUnavailableError` naming it,
the folder and how to fetch it. There is no fallback to synthetic data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, List, Optional

import numpy as np
import torch

from rfedray.options import DTYPES, OptionsError
from rfedray.data.validation import first_nonfinite, spd_problem
from rfedray.errors import RfedrayError
from rfedray.paths import cache_dir
from rfedray.progress import bar
from rfedray.task import ClientData, EvalData

ESTIMATORS = ("oas", "lwf", "sch")
HOLDOUTS = ("test", "validation")
MICROVOLT = "uV"
CACHE_FORMAT = 1
REPOSITORY = Path(__file__).resolve().parents[2]


class DatasetUnavailableError(RfedrayError):
    """An EEG dataset that is neither on disk nor downloadable from here."""


@dataclass(frozen=True)
class DatasetSpec:
    """What rfedray needs to know about one MOABB dataset.

    Attributes
    ----------
    name : str
        The MOABB class name (``moabb.datasets.<name>``).
    paradigm : str
        The MOABB paradigm class (``moabb.paradigms.<paradigm>``).
    events : tuple of str
        Class names; label ``k`` is ``events[k]``.
    channels : int
        Number of EEG channels MOABB returns.
    subjects : tuple of int
        Default subjects.
    available : tuple of int
        Every subject of the dataset.
    window_s : float
        Length of MOABB's epoch interval, in seconds.
    endpoint : int
        1 if the paper's T counts the interval's last sample (``floor(window * fs) + 1``), else 0.
    sign : str
        MNE/MOABB signifier: the data folder is ``MNE_DATASETS_<sign>_PATH``.
    paradigm_kwargs : dict
        Extra keyword arguments of the paradigm.
    attributes : dict
        Attributes set on the MOABB dataset object before loading.
    default_path : Path or None
        Where the data is looked for when neither the option nor the environment says.
    """

    name: str
    paradigm: str
    events: tuple[str, ...]
    channels: int
    subjects: tuple[int, ...]
    available: tuple[int, ...]
    window_s: float
    endpoint: int
    sign: str
    paradigm_kwargs: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    default_path: Optional[Path] = None

    def n_times(self, resample: float) -> int:
        """Samples per trial at ``resample`` Hz (the paper's T at 128 Hz)."""
        return int(self.window_s * resample + 1e-9) + self.endpoint

    def data_path(self, override: str) -> Path:
        """The data folder: the option, else ``MNE_DATASETS_<sign>_PATH``, else the default."""
        candidates = [override, os.environ.get(self.env_key, ""), str(self.default_path or "")]
        return Path(next((c for c in candidates if c), None) or _mne_data_home()).expanduser()

    @property
    def env_key(self) -> str:
        return f"MNE_DATASETS_{self.sign}_PATH"


def _mne_data_home() -> str:
    """MNE's ``MNE_DATA`` (environment or MNE's config file), else ``~/mne_data``."""
    import mne

    return mne.get_config("MNE_DATA", "") or str(Path.home() / "mne_data")


_BNCI_EVENTS = ("left_hand", "right_hand", "feet", "tongue")
_WEIBO_EVENTS = ("left_hand", "right_hand", "hands", "feet", "left_hand_right_foot", "right_hand_left_foot", "rest")
_LEFT_RIGHT = ("left_hand", "right_hand")

DATASETS: dict[str, DatasetSpec] = {
    "BNCI2014_001": DatasetSpec(
        name="BNCI2014_001", paradigm="MotorImagery", events=_BNCI_EVENTS, channels=22,
        subjects=tuple(range(1, 10)), available=tuple(range(1, 10)), window_s=4.0, endpoint=1, sign="BNCI",
        paradigm_kwargs={"n_classes": 4, "events": list(_BNCI_EVENTS)},
    ),
    "Weibo2014": DatasetSpec(
        name="Weibo2014", paradigm="MotorImagery", events=_WEIBO_EVENTS, channels=60,
        subjects=tuple(range(1, 11)), available=tuple(range(1, 11)), window_s=4.0, endpoint=1, sign="WEIBO",
        paradigm_kwargs={"n_classes": 7, "events": list(_WEIBO_EVENTS)},
    ),
    "Cho2017": DatasetSpec(
        name="Cho2017", paradigm="LeftRightImagery", events=_LEFT_RIGHT, channels=64,
        subjects=tuple(range(1, 53)), available=tuple(range(1, 53)), window_s=3.0, endpoint=0, sign="GIGADB",
    ),
    "PhysionetMI": DatasetSpec(
        name="PhysionetMI", paradigm="LeftRightImagery", events=_LEFT_RIGHT, channels=64,
        subjects=tuple(range(1, 18)), available=tuple(range(1, 110)), window_s=3.0, endpoint=0, sign="EEGBCI",
        attributes={"hand_runs": [4, 8, 12], "feet_runs": []},
        default_path=REPOSITORY.parent / "shared" / "data" / "eegmmidb",
    ),
}


@dataclass(frozen=True)
class Preprocessing:
    """MOABB preprocessing of one dataset: band-pass, resampling and the trial length."""

    spec: DatasetSpec
    fmin: float
    fmax: float
    resample: float
    n_times: int
    channels: Optional[tuple[str, ...]] = None

    @property
    def n_channels(self) -> int:
        """Channels of a trial: the chosen ones, else every EEG channel of the dataset."""
        return len(self.channels) if self.channels is not None else self.spec.channels

    def key(self) -> dict[str, Any]:
        key = {
            "dataset": self.spec.name, "paradigm": self.spec.paradigm, "events": list(self.spec.events),
            "attributes": self.spec.attributes, "fmin": self.fmin, "fmax": self.fmax,
            "resample": self.resample, "n_times": self.n_times, "unit": MICROVOLT,
        }
        if self.channels is not None:
            key["channels"] = list(self.channels)
        return key


class CovarianceRepresentation:
    """Shrinkage covariance of each trial, divided by its mean eigenvalue.

    Parameters
    ----------
    estimator : str
        A pyriemann shrinkage estimator: ``oas``, ``lwf`` or ``sch``.
    """

    name = "covariance"

    def __init__(self, estimator: str = "oas"):
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator={estimator!r}: must be one of {', '.join(ESTIMATORS)}")
        self.estimator = estimator

    @classmethod
    def from_options(cls, options: "Options") -> "CovarianceRepresentation":
        return cls(options.estimator)

    def key(self) -> dict[str, Any]:
        return {"representation": self.name, "estimator": self.estimator, "normalisation": "mean-eigenvalue"}

    def record_shape(self, channels: int, n_times: int) -> tuple[int, ...]:
        return (channels, channels)

    def transform(self, trials: np.ndarray) -> np.ndarray:
        """Trials of shape (n, C, T) -> trace-normalised covariances (n, C, C), float64."""
        from pyriemann.estimation import Covariances

        covs = Covariances(estimator=self.estimator).fit_transform(trials.astype(np.float64))
        mean_eig = np.trace(covs, axis1=-2, axis2=-1) / covs.shape[-1]
        covs = covs / mean_eig[:, None, None]
        return 0.5 * (covs + np.swapaxes(covs, -1, -2))

    @staticmethod
    def problem(features: np.ndarray) -> Optional[str]:
        """The first covariance that is not finite or not symmetric positive definite, or None."""
        return first_nonfinite(features) or spd_problem(features)


class RawRepresentation:
    """The trial itself, shape (C, T), in microvolts, float32."""

    name = "raw"

    @classmethod
    def from_options(cls, options: "Options") -> "RawRepresentation":
        return cls()

    def key(self) -> dict[str, Any]:
        return {"representation": self.name}

    def record_shape(self, channels: int, n_times: int) -> tuple[int, ...]:
        return (channels, n_times)

    def transform(self, trials: np.ndarray) -> np.ndarray:
        return trials.astype(np.float32)

    @staticmethod
    def problem(features: np.ndarray) -> Optional[str]:
        """The first trial holding a NaN or an infinity, or None."""
        return first_nonfinite(features)


REPRESENTATIONS = {"covariance": CovarianceRepresentation, "raw": RawRepresentation}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {k: os.environ[k] for k in values if k in os.environ}
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            os.environ.pop(k, None)
        os.environ.update(saved)


def fetch_hint(spec: DatasetSpec, path: Path) -> str:
    return (
        f"fetch it on a machine with network access with `python -c \"from moabb.datasets import {spec.name}; "
        f"{spec.name}().download(path='{path}')\"` (add accept=True where MOABB asks for a licence) and copy the "
        f"folder here, or point data.options.data_path or {spec.env_key} to where it is"
    )


def load_subject_trials(prep: Preprocessing, subject: int, data_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Load and preprocess one subject through MOABB.

    Parameters
    ----------
    prep : Preprocessing
    subject : int
    data_path : Path
        The folder MNE/MOABB keep this dataset in (``MNE_DATASETS_<sign>_PATH``).

    Returns
    -------
    trials : ndarray, shape (n, C, prep.n_times), float64, microvolts
    labels : ndarray, shape (n,), int64, indices into ``prep.spec.events``

    Raises
    ------
    DatasetUnavailableError
        If the files are not under ``data_path`` and cannot be downloaded.
    """
    import mne
    import moabb.datasets
    import moabb.paradigms

    spec = prep.spec
    env = {spec.env_key: str(data_path), "MOABB_DOWNLOAD_PROVIDER": os.environ.get("MOABB_DOWNLOAD_PROVIDER", "upstream")}
    with _environment(env), mne.utils.use_log_level("ERROR"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = getattr(moabb.datasets, spec.name)()
        for name, value in spec.attributes.items():
            setattr(dataset, name, value)
        channels = list(prep.channels) if prep.channels is not None else None
        paradigm = getattr(moabb.paradigms, spec.paradigm)(
            fmin=prep.fmin, fmax=prep.fmax, resample=prep.resample, channels=channels, **spec.paradigm_kwargs
        )
        try:
            trials, labels, _ = paradigm.get_data(dataset, subjects=[subject])
        except ValueError as exc:
            if channels is None or "channel" not in str(exc).lower():
                raise
            raise OptionsError("data.options.channels", channels, f"{spec.name} (subject {subject}) does not have all of "
                              f"these channels ({exc})") from None
        except OSError as exc:
            raise DatasetUnavailableError(
                f"EEG dataset {spec.name} (subject {subject}) is not on disk under {data_path} "
                f"({spec.env_key}) and could not be downloaded ({type(exc).__name__}: {exc}); "
                + fetch_hint(spec, data_path)
            ) from exc
    if trials.shape[1] != prep.n_channels or trials.shape[2] < prep.n_times:
        raise DatasetUnavailableError(
            f"EEG dataset {spec.name} (subject {subject}) under {data_path}: MOABB returned trials of shape "
            f"{trials.shape[1:]}, expected ({prep.n_channels}, >= {prep.n_times})"
        )
    names, inverse = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
    codes = np.array([spec.events.index(name) for name in names], dtype=np.int64)
    return trials[:, :, : prep.n_times], codes[inverse]


class SubjectCache:
    """Preprocessed arrays of one dataset and preprocessing, one ``.npz`` per subject.

    Parameters
    ----------
    root : Path
        The cache directory.
    key : dict
        Every preprocessing parameter (JSON-serialisable); its hash names the folder.
    """

    def __init__(self, root: Path, key: dict[str, Any]):
        text = json.dumps(key, sort_keys=True, default=str)
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.folder = Path(root) / str(key["dataset"]) / self.digest
        self.key_text = text

    def path(self, subject: int) -> Path:
        return self.folder / f"subject_{subject:03d}.npz"

    def read(self, subject: int, *names: str) -> Optional[tuple[np.ndarray, ...]]:
        """The arrays ``names`` (``"x"`` features, ``"y"`` labels) of a subject, or None if not cached."""
        path = self.path(subject)
        if not path.is_file():
            return None
        with np.load(path) as f:
            return tuple(f[name] for name in names)

    def save(self, subject: int, x: np.ndarray, y: np.ndarray) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        key_file = self.folder / "key.json"
        if not key_file.is_file():
            _atomic_write(key_file, lambda fh: fh.write(self.key_text.encode()))
        _atomic_write(self.path(subject), lambda fh: np.savez(fh, x=x, y=y))


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def held_out_counts(class_counts: np.ndarray, test_fraction: float) -> np.ndarray:
    """Test records per class: ``round(test_fraction * n_k)`` (half to even)."""
    return np.rint(test_fraction * class_counts).astype(np.int64)


def train_size(labels: np.ndarray, test_fraction: float, validation_fraction: float = 0.0) -> int:
    """Training records left by :func:`split_client` of ``labels`` (shape (n,), int): the test split
    held out, then (``validation_fraction > 0``) a validation split of the remaining records."""
    counts = np.bincount(labels)
    counts = counts - held_out_counts(counts, test_fraction)
    return int(counts.sum() - held_out_counts(counts, validation_fraction).sum())


def stratified_split(labels: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random train/test indices with ``round(test_fraction * n_k)`` test records of each class k.

    Parameters
    ----------
    labels : ndarray, shape (n,), int
    test_fraction : float in (0, 1)
    rng : numpy Generator

    Returns
    -------
    train, test : ndarray of int, sorted
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r}: must be in the open interval (0, 1)")
    perm = rng.permutation(labels.shape[0])
    order = perm[np.argsort(labels[perm], kind="stable")]
    sorted_labels = labels[order]
    counts = np.bincount(labels)
    rank = np.arange(labels.shape[0]) - (np.cumsum(counts) - counts)[sorted_labels]
    n_test = held_out_counts(counts, test_fraction)
    is_test = rank < n_test[sorted_labels]
    return np.sort(order[~is_test]), np.sort(order[is_test])


@dataclass(frozen=True)
class Holdout:
    """How a unit's trials (a subject's, or a client's) are held out: a test split, and for the
    hyperparameter search a validation split inside the training records.

    Attributes
    ----------
    test_fraction : float in (0, 1)
        Of each class, held out for testing.
    test_seed : int
        Seeds the test split.
    validation_fraction : float in (0, 1) or None
        ``None``: the unit's held-out records are its test split. Otherwise the test split is cut
        exactly as without it and set aside (never returned), and this fraction of each class of
        the remaining training records is held out instead, by a second random stream: the split
        hyperparameters are chosen on. The search's training records are then a subset of the
        real runs' training records, and nothing of the test split takes part.
    validation_seed : int
        Seeds the validation split.
    """

    test_fraction: float
    test_seed: int
    validation_fraction: Optional[float] = None
    validation_seed: int = 0

    def indices(self, labels: np.ndarray, key: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Training and held-out indices of a unit's ``labels`` (shape (n,), int), sorted; ``key``
        names the unit in the random streams (the same unit gets the same split in every process)."""
        rng = np.random.default_rng(np.random.SeedSequence(entropy=self.test_seed, spawn_key=key))
        train, test = stratified_split(labels, self.test_fraction, rng)
        if self.validation_fraction is None:
            return train, test
        rng = np.random.default_rng(np.random.SeedSequence(entropy=self.validation_seed, spawn_key=(*key, 1)))
        kept, held = stratified_split(labels[train], self.validation_fraction, rng)
        return train[kept], train[held]

    def train_size(self, labels: np.ndarray) -> int:
        """Training records :meth:`indices` leaves of ``labels`` (shape (n,), int)."""
        return train_size(labels, self.test_fraction, self.validation_fraction or 0.0)


def as_records(features: np.ndarray, labels: np.ndarray, index: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The records at ``index`` as tensors: features in ``dtype``, labels int64."""
    return torch.as_tensor(features[index], dtype=dtype), torch.as_tensor(labels[index], dtype=torch.int64)


def split_client(
    features: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int, client_id: int, dtype: torch.dtype,
) -> ClientData:
    """A client's stratified train/test split, as tensors (features in ``dtype``, labels int64)."""
    train, test = Holdout(test_fraction, seed).indices(labels, (0xEE6, client_id))
    return ClientData(train=as_records(features, labels, train, dtype), test=as_records(features, labels, test, dtype))


def union_of_tests(clients: list[ClientData]) -> EvalData:
    """The server's evaluation data: every client's test split, concatenated."""
    tensors = tuple(torch.cat(parts) for parts in zip(*(c.test for c in clients)))
    return EvalData(tensors=tensors, extra={"test_sizes": [int(c.test[0].shape[0]) for c in clients]})


def group_subjects(subjects: list[int], n_clients: int) -> list[list[int]]:
    """Contiguous groups of subjects, sizes differing by at most one."""
    return [list(map(int, g)) for g in np.array_split(np.asarray(subjects), n_clients)]


def default_cache_dir() -> Path:
    """``eeg`` in :func:`rfedray.paths.cache_dir` (``RFEDRAY_CACHE_DIR``, else the user's cache folder)."""
    return cache_dir() / "eeg"


@dataclass
class Options:
    """Schema of ``data.options`` for ``data.source: moabb``.

    Attributes
    ----------
    dataset : str
        One of :data:`DATASETS`.
    representation : str
        ``covariance`` (SPDNet) or ``raw`` (EEGNet).
    subjects : list of int or None
        Subjects to use, in order; ``None`` is the dataset's default (see the module docstring).
    fmin, fmax : float
        Band-pass edges in Hz.
    resample : float
        Sampling rate after resampling, in Hz.
    n_times : int or None
        Samples per trial; ``None`` is the paper's T (``floor(window * resample) + endpoint``).
    estimator : str
        Covariance estimator with shrinkage (``oas``, ``lwf``, ``sch``).
    channels : list of str or None
        EEG channels to keep, by name, in this order (MOABB picks them); ``None`` keeps every EEG
        channel of the dataset.
    test_fraction : float
        Fraction of each client's trials (per class) held out for testing.
    evaluate_on : str
        ``test`` (the runs): the model is evaluated on the subjects' test splits.
        ``validation`` (hyperparameter search): every test split is set aside unseen, and
        ``validation_fraction`` of each subject's training trials (per class) are held out and
        evaluated on instead (:class:`Holdout`; the validation split is seeded by ``run.seed``).
    validation_fraction : float
        Fraction of each subject's training trials (per class) in its validation split.
    split_seed : int or None
        Seed of the train/test splits; ``None`` uses ``run.seed``. A fixed value keeps one test
        split for every seed, which a hyperparameter search on validation splits needs (a test
        split of one seed is training data of another).
    data_path : str
        Folder of the raw files; empty uses ``MNE_DATASETS_<SIGN>_PATH`` or the default.
    cache_dir : str
        Folder of the preprocessed arrays; empty uses :func:`default_cache_dir`.
    dtype : str
        ``float32`` or ``float64``.
    """

    dataset: str = "PhysionetMI"
    representation: str = "covariance"
    subjects: Optional[List[int]] = None
    fmin: float = 8.0
    fmax: float = 30.0
    resample: float = 128.0
    n_times: Optional[int] = None
    estimator: str = "oas"
    channels: Optional[List[str]] = None
    test_fraction: float = 0.25
    evaluate_on: str = "test"
    validation_fraction: float = 0.25
    split_seed: Optional[int] = None
    data_path: str = ""
    cache_dir: str = ""
    dtype: str = "float32"

    def validate(self, prefix: str) -> None:
        OptionsError.one_of(f"{prefix}.dataset", self.dataset, DATASETS)
        OptionsError.one_of(f"{prefix}.representation", self.representation, REPRESENTATIONS)
        spec = DATASETS[self.dataset]
        if self.subjects is not None and (not self.subjects or len(set(self.subjects)) != len(self.subjects)):
            raise OptionsError(f"{prefix}.subjects", self.subjects, "must be null or a non-empty list of distinct subject numbers")
        if self.subjects is not None and not set(self.subjects) <= set(spec.available):
            raise OptionsError(f"{prefix}.subjects", self.subjects, f"{self.dataset} has subjects {spec.available[0]}..{spec.available[-1]}")
        OptionsError.check(0.0 < self.resample, f"{prefix}.resample", self.resample, "must be a sampling rate in Hz > 0")
        if not 0.0 <= self.fmin < self.fmax:
            raise OptionsError(f"{prefix}.fmin", self.fmin, f"must be in [0, fmax) (fmax = {self.fmax} Hz)")
        if not self.fmax < self.resample / 2:
            raise OptionsError(f"{prefix}.fmax", self.fmax, f"must be below the Nyquist frequency resample/2 ({self.resample / 2} Hz)")
        if self.n_times is not None and not 1 <= self.n_times <= spec.n_times(self.resample):
            longest = spec.n_times(self.resample)
            raise OptionsError(f"{prefix}.n_times", self.n_times, f"must be null or in [1, {longest}] (the epoch length)")
        OptionsError.one_of(f"{prefix}.estimator", self.estimator, ESTIMATORS)
        if self.channels is not None and (not self.channels or len(set(self.channels)) != len(self.channels)
                                          or not all(isinstance(c, str) and c for c in self.channels)):
            raise OptionsError(f"{prefix}.channels", self.channels, "must be null (every channel) or a non-empty list of distinct channel names")
        if not 0.0 < self.test_fraction < 1.0:
            raise OptionsError(f"{prefix}.test_fraction", self.test_fraction, "must be in the open interval (0, 1)")
        OptionsError.one_of(f"{prefix}.evaluate_on", self.evaluate_on, HOLDOUTS)
        if not 0.0 < self.validation_fraction < 1.0:
            raise OptionsError(f"{prefix}.validation_fraction", self.validation_fraction, "must be in the open interval (0, 1)")
        if self.split_seed is not None and self.split_seed < 0:
            raise OptionsError(f"{prefix}.split_seed", self.split_seed, "must be null (run.seed) or an integer >= 0")
        OptionsError.one_of(f"{prefix}.dtype", self.dtype, DTYPES)


def _versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in ("moabb", "mne", "pyriemann")}


class MOABBEEG:
    """A MOABB motor-imagery dataset as a federation (implements :class:`rfedray.task.FederatedDataset`).

    Parameters
    ----------
    options : Options
        Validated options.
    n_clients : int
        Number of clients; the subjects are cut into this many contiguous groups.
    seed : int
        Seeds the train/test splits unless ``options.split_seed`` is set.

    Attributes
    ----------
    info : dict
        ``task``, ``dataset``, ``representation``, ``channels``, ``n_times``, ``num_classes``,
        ``classes``, ``record_shape``, ``dtype``, ``subjects`` (per client) and ``cache``.
    """

    def __init__(self, options: Options, *, n_clients: int, seed: int):
        options.validate("data.options")
        spec = DATASETS[options.dataset]
        subjects = list(options.subjects if options.subjects is not None else spec.subjects)
        if not 1 <= n_clients <= len(subjects):
            raise OptionsError("federation.n_clients", n_clients, f"must be between 1 and the number of subjects ({len(subjects)})")
        self.options = options
        self.spec = spec
        self.num_clients = n_clients
        self.split_seed = seed if options.split_seed is None else options.split_seed
        self.subjects = group_subjects(subjects, n_clients)
        self.preprocessing = Preprocessing(
            spec, options.fmin, options.fmax, options.resample,
            options.n_times if options.n_times is not None else spec.n_times(options.resample),
            tuple(options.channels) if options.channels is not None else None,
        )
        self.holdout = Holdout(
            options.test_fraction, self.split_seed,
            options.validation_fraction if options.evaluate_on == "validation" else None, seed,
        )
        self.representation = REPRESENTATIONS[options.representation].from_options(options)
        self.data_path = spec.data_path(options.data_path)
        key = {**self.preprocessing.key(), **self.representation.key(), "versions": _versions(), "format": CACHE_FORMAT}
        self.cache = SubjectCache(Path(options.cache_dir).expanduser() if options.cache_dir else default_cache_dir(), key)
        self.dtype = DTYPES[options.dtype]
        self.info = {
            "task": "classification", "dataset": spec.name, "representation": options.representation,
            "channels": self.preprocessing.n_channels, "n_times": self.preprocessing.n_times,
            "channel_names": list(options.channels) if options.channels is not None else None,
            "num_classes": len(spec.events), "classes": list(spec.events),
            "record_shape": self.representation.record_shape(self.preprocessing.n_channels, self.preprocessing.n_times),
            "dtype": options.dtype, "subjects": self.subjects, "cache": str(self.cache.folder),
            "evaluated_on": options.evaluate_on,
        }

    def subject_arrays(self, subject: int) -> tuple[np.ndarray, np.ndarray]:
        """Features and labels of one subject, from the cache or preprocessed and cached now.

        Raises
        ------
        OptionsError
            Naming ``data.options.subjects`` when a trial's features are unusable (not finite; for
            covariances, not symmetric positive definite, e.g. from a flat or duplicated channel).
        """
        cached = self.cache.read(subject, "x", "y")
        if cached is not None:
            features, labels = cached
            source = f"the cached file {self.cache.path(subject)}"
        else:
            trials, labels = load_subject_trials(self.preprocessing, subject, self.data_path)
            features = self.representation.transform(trials)
            source = f"the recording under {self.data_path}"
        problem = self.representation.problem(features)
        if problem is not None:
            raise OptionsError(
                "data.options.subjects", [s for group in self.subjects for s in group],
                f"{self.spec.name} subject {subject}, {self.options.representation} features: {problem} "
                f"(from {source}); leave the subject out of data.options.subjects, or delete the cache "
                f"folder {self.cache.folder} if the file is damaged",
            )
        if cached is None:
            self.cache.save(subject, features, labels)
        return features, labels

    def client_data(self, client_id: int) -> ClientData:
        """The client's records: each of its subjects' training (held-out) split, concatenated."""
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client_id={client_id}: must be in [0, {self.num_clients - 1}]")
        train, held = [], []
        for subject in self.subjects[client_id]:
            features, labels = self.subject_arrays(subject)
            kept, out = self.holdout.indices(labels, (0xEE6, 0x5B, subject))
            train.append(as_records(features, labels, kept, self.dtype))
            held.append(as_records(features, labels, out, self.dtype))
        join = lambda parts: tuple(torch.cat(t) for t in zip(*parts))  # noqa: E731
        return ClientData(train=join(train), test=join(held))

    def client_sizes(self) -> list[int]:
        """Training records per client (from the cached labels; preprocesses what is missing, with a
        progress bar on a terminal)."""
        missing = [s for group in self.subjects for s in group if not self.cache.path(s).is_file()]
        for subject in bar(missing, desc=f"{self.spec.name}: preprocessing", unit="subject"):
            self.subject_arrays(subject)
        return [sum(self.holdout.train_size((self.cache.read(s, "y") or self.subject_arrays(s)[1:])[0]) for s in group)
                for group in self.subjects]

    def eval_data(self) -> EvalData:
        """The union of every client's test split (its validation split with ``evaluate_on: validation``)."""
        return union_of_tests([self.client_data(i) for i in range(self.num_clients)])


def build(options: Options, *, n_clients: int, seed: int) -> MOABBEEG:
    return MOABBEEG(options, n_clients=n_clients, seed=seed)
