"""What a federated task is made of: a model whose parameters are grouped by manifold, and data
partitioned over clients.

The federated core (:mod:`rfedray.federated`) only talks to these two interfaces, so a new model or
data source is a new module registered in :mod:`rfedray.registry`, nothing else; the user's own
are objects given to :func:`rfedray.api.run` or plugins named by import path
(:mod:`rfedray.plugins`). Your own data subclasses :class:`ClientPartitions`; your own
``torch.nn.Module`` becomes a model through :class:`rfedray.models.module.ModuleModel`.

Parameters of a model are a ``dict[str, Tensor]`` (a point of a product manifold, one factor per
group). Records of a client are a tuple of tensors with the record index as the leading dimension,
e.g. ``(z,)`` with ``z`` of shape ``(m, d)`` for federated PCA or ``(X, y)`` for classification.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import Tensor

Params = dict[str, Tensor]


def initial_theta(model: "FederatedModel", seed: int) -> Params:
    """theta_0 of a run of seed ``seed`` (the same on every engine and in every system)."""
    return model.init_params(torch.Generator().manual_seed(seed * 7919 + 17))


@dataclass
class ClientData:
    """One client's private records and its own held-out test records (both stay on the client).

    Attributes
    ----------
    train : tuple of Tensor
        Training records, each of shape ``(m, ...)``.
    test : tuple of Tensor or None
        The client's local test split, if the task has one, in the form of :attr:`EvalData.tensors`:
        with ``run.test_set: clients`` the client evaluates the model on it where it is hosted
        (:mod:`rfedray.federated.evaluation`).
    """

    train: tuple[Tensor, ...]
    test: tuple[Tensor, ...] | None = None

    @property
    def num_records(self) -> int:
        return int(self.train[0].shape[0])


@dataclass
class EvalData:
    """Data the server evaluates on with ``run.test_set: server``, in the server process.

    A test set the server holds (not part of any training transcript); for EEG sources the union
    of the clients' test splits (which the server process then loads: a simulation choice). For synthetic tasks it may be a simulation oracle (e.g. the pooled covariance of
    federated PCA), computed from the training records themselves: ``oracle=True`` marks it, and
    :meth:`labelled` names its metrics ``oracle_*`` wherever they go. A metric of the training
    records is not covered by the privacy guarantee (replacing one record moves it by far more
    than its float resolution), so runs keep oracle metrics off the progress line and Prometheus
    unless ``monitoring.export_oracle_metrics`` is set.
    """

    tensors: tuple[Tensor, ...]
    oracle: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def labelled(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """``metrics`` evaluated on these data, each named ``oracle_<name>`` when they are an oracle."""
        return {f"oracle_{k}": v for k, v in metrics.items()} if self.oracle else dict(metrics)


class FederatedDataset(Protocol):
    """Client partitions, loadable independently (by whichever process hosts the client)."""

    num_clients: int
    info: dict[str, Any]  # what models and engines read: "task", "dtype", "record_shape" (one record's shape), ...

    def client_data(self, client_id: int) -> ClientData:
        """Load (or generate) the partition of one client, deterministically."""

    def client_sizes(self) -> list[int]:
        """Number of training records of every client (public metadata: used for accounting)."""

    def eval_data(self) -> EvalData:
        """What the server evaluates on with ``run.test_set: server``, loaded in the server process
        (the default, ``clients``, never calls it: each client evaluates its own test split)."""


class ClientPartitions(ABC):
    """Base class of the user's own federated data: client sizes up front, records loaded per client.

    The two halves of the interface live in different places. :meth:`client_sizes` is public
    metadata, read once where the run starts: the accountant's sampling rate ``B / m`` of every
    client comes from it (a client whose records do not number its declared size is refused). The
    records are loaded by :meth:`client_data`, called only in the process that hosts the client (a
    client actor on the Ray engine, the driver on the local engine), so they never travel. The
    object itself travels (pickled to every actor, or built there again from a plugin's options):
    keep in it how to load the records (paths, seeds), not the records.

    Subclasses implement :meth:`client_sizes`, :meth:`client_data` and, if the server evaluates
    the model, :meth:`eval_data`; they may set :attr:`info`, the public description models read
    (e.g. ``num_classes``). ``num_clients`` is the number of sizes.

    Attributes
    ----------
    info : dict
        Public facts about the data that a model factory may need (shapes, classes); no records.
        ``record_shape``, the shape of one record's first tensor, lets rfedray choose the threads
        of the processes that train (:mod:`rfedray.threads`); without it they train with one
        thread unless ``run.threads`` says otherwise.
    """

    info: dict[str, Any] = {}

    @abstractmethod
    def client_sizes(self) -> list[int]:
        """Number of training records of every client, in client order (public metadata)."""

    @abstractmethod
    def client_data(self, client_id: int) -> ClientData:
        """Load the records of client ``client_id`` (in the process hosting it), deterministically."""

    def eval_data(self) -> EvalData:
        """What the server evaluates the global model on with ``run.test_set: server`` (loaded in the
        server process; the default, ``clients``, does not call it): nothing unless overridden."""
        return EvalData(())

    @property
    def num_clients(self) -> int:
        return len(self.client_sizes())


class FederatedModel(Protocol):
    """A model as the private step needs it: functional, with parameters grouped by manifold."""

    groups: Mapping[str, Any]  # group name -> rfedray.geometry.Manifold
    gradient_rule: Any  # a rfedray.privacy.mechanism.PerSampleRule, or None: per-record gradients by vmap(grad)

    def init_params(self, generator: torch.Generator) -> Params:
        """A starting point on the product manifold."""

    def per_sample_loss(self, params: Params, *record: Tensor) -> Tensor:
        """The loss of one record (no batch dimension), a scalar; vmapped by the private step."""

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        """Metrics of the global model (e.g. ``accuracy``, ``loss`` or ``gap``)."""


LossFn = Callable[..., Tensor]
