"""Small synthetic EEG with class-dependent spatial covariances, for unit tests and smoke runs.

A trial of class ``k`` of client ``i`` is ``X = M_i diag(sqrt(p_k)) S`` in volts, shape ``(C, T)``,
where ``S`` has independent standard normal entries (C sources, T samples), ``p_k`` is the power of
the sources under class ``k`` (1 everywhere, ``1 + separation`` on source ``k mod C``), and
``M_i = amplitude * Pi_O(M + heterogeneity * G_i)`` mixes the sources into the channels through an
orthogonal matrix near a common one (``Pi_O`` the polar factor; ``G_i`` Gaussian, one per client).
The amplitude (1e-5 V by default) is that of real scalp EEG, so covariances are ~1e-10 V^2.

Trials go through the same steps as the real data of :mod:`rfedray.data.eeg`: conversion to
microvolts (MOABB's unit), then the ``covariance`` representation (shrinkage estimate divided by
its mean eigenvalue) or the ``raw`` one; the same stratified per-client train/test split, each
client evaluating on its own (``eval_data`` is their union, for ``run.test_set: server``). Everything is a deterministic function of
``(seed, client_id)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rfedray.data.eeg import ESTIMATORS, REPRESENTATIONS, split_client, train_size, union_of_tests
from rfedray.options import DTYPES, NON_NEGATIVE, Checked, OptionsError, Rule, at_least, one_of, ranged
from rfedray.task import ClientData, EvalData

MICROVOLTS_PER_VOLT = 1e6


@dataclass
class Options(Checked):
    """Schema of ``data.options`` for ``data.source: synthetic_eeg``.

    Attributes
    ----------
    channels, n_times, num_classes : int
        ``C``, ``T`` and ``K``.
    trials_per_client : int
        Trials of each client (train and test), balanced over the classes.
    separation : float
        Extra power of the class's source (0: classes indistinguishable).
    heterogeneity : float
        Spread of the clients' mixing matrices around the common one.
    amplitude : float
        Scale of the signals, in volts.
    representation, estimator, test_fraction, dtype
        As in :class:`rfedray.data.eeg.Options`.
    """

    channels: int = ranged(8, at_least(2))
    n_times: int = ranged(128, at_least(2))
    num_classes: int = ranged(2, at_least(2))
    trials_per_client: int = 48
    separation: float = ranged(1.0, NON_NEGATIVE)
    heterogeneity: float = ranged(0.1, NON_NEGATIVE)
    amplitude: float = ranged(1e-5, Rule(lambda v: 0 < v < float("inf"), "must be a finite number > 0 (volts)"))
    representation: str = ranged("covariance", one_of(REPRESENTATIONS))
    estimator: str = ranged("oas", one_of(ESTIMATORS))
    test_fraction: float = ranged(0.25, Rule(lambda v: 0.0 < v < 1.0, "must be in the open interval (0, 1)"))
    dtype: str = ranged("float32", one_of(DTYPES))

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.trials_per_client < 2 * self.num_classes:
            raise OptionsError(f"{prefix}.trials_per_client", self.trials_per_client, f"must be >= 2 * num_classes ({2 * self.num_classes})")


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(0x5EE6,) + key))


def _polar(a: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(a)
    return u @ vt


class SyntheticEEG:
    """A federation of synthetic EEG clients (implements :class:`rfedray.task.FederatedDataset`).

    Parameters
    ----------
    options : Options
    n_clients : int
    seed : int
        Seeds the common mixing, every client's mixing, labels, trials and split.
    """

    def __init__(self, options: Options, *, n_clients: int, seed: int):
        options.validate("data.options")
        OptionsError.check(n_clients >= 1, "federation.n_clients", n_clients, "must be an integer >= 1")
        self.options = options
        self.num_clients = n_clients
        self.seed = seed
        self.dtype = DTYPES[options.dtype]
        self.representation = REPRESENTATIONS[options.representation].from_options(options)
        o = options
        self.info = {
            "task": "classification", "dataset": "synthetic_eeg", "representation": o.representation,
            "channels": o.channels, "n_times": o.n_times, "num_classes": o.num_classes,
            "classes": [f"class{k}" for k in range(o.num_classes)],
            "record_shape": self.representation.record_shape(o.channels, o.n_times), "dtype": o.dtype,
        }

    def labels(self, client_id: int) -> np.ndarray:
        """Balanced labels of a client, in a random order, shape (trials_per_client,)."""
        o = self.options
        return _rng(self.seed, 1, client_id).permutation(np.arange(o.trials_per_client) % o.num_classes)

    def trials(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Trials in volts, shape (m, C, T), and their labels, shape (m,)."""
        o = self.options
        rng = _rng(self.seed, 2, client_id)
        common = _rng(self.seed, 0).standard_normal((o.channels, o.channels))
        mixing = o.amplitude * _polar(common + o.heterogeneity * rng.standard_normal((o.channels, o.channels)))
        labels = self.labels(client_id)
        power = np.ones((o.num_classes, o.channels))
        power[np.arange(o.num_classes), np.arange(o.num_classes) % o.channels] += o.separation
        sources = rng.standard_normal((labels.shape[0], o.channels, o.n_times)) * np.sqrt(power[labels])[:, :, None]
        return np.einsum("cs,nst->nct", mixing, sources), labels

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client_id={client_id}: must be in [0, {self.num_clients - 1}]")
        trials, labels = self.trials(client_id)
        features = self.representation.transform(trials * MICROVOLTS_PER_VOLT)
        return split_client(features, labels, self.options.test_fraction, self.seed, client_id, self.dtype)

    def client_sizes(self) -> list[int]:
        return [train_size(self.labels(i), self.options.test_fraction) for i in range(self.num_clients)]

    def eval_data(self) -> EvalData:
        """The union of every client's test split."""
        return union_of_tests([self.client_data(i) for i in range(self.num_clients)])


def build(options: Options, *, n_clients: int, seed: int) -> SyntheticEEG:
    return SyntheticEEG(options, n_clients=n_clients, seed=seed)
