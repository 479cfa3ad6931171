"""What a federated task is made of: a model whose parameters are grouped by manifold, and data
partitioned over clients.

The federated core (:mod:`rfedray.federated`) only talks to these two interfaces, so a new model or
data source is a new module registered in :mod:`rfedray.registry`, nothing else.

Parameters of a model are a ``dict[str, Tensor]`` (a point of a product manifold, one factor per
group). Records of a client are a tuple of tensors with the record index as the leading dimension,
e.g. ``(z,)`` with ``z`` of shape ``(m, d)`` for federated PCA or ``(X, y)`` for classification.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import Tensor

Params = dict[str, Tensor]


@dataclass
class ClientData:
    """One client's private records and its own held-out test records (both stay on the client).

    Attributes
    ----------
    train : tuple of Tensor
        Training records, each of shape ``(m, ...)``.
    test : tuple of Tensor or None
        The client's local test split, if the task has one.
    """

    train: tuple[Tensor, ...]
    test: tuple[Tensor, ...] | None = None

    @property
    def num_records(self) -> int:
        return int(self.train[0].shape[0])


@dataclass
class EvalData:
    """Data the server may evaluate on without touching any client's training records.

    For tasks with held-out test sets this is the union of those sets (not part of any training
    transcript). For synthetic tasks it may be a simulation oracle (e.g. the pooled covariance of
    federated PCA); ``oracle=True`` marks it so reports and docs can say so.
    """

    tensors: tuple[Tensor, ...]
    oracle: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class FederatedDataset(Protocol):
    """Client partitions, loadable independently (by whichever process hosts the client)."""

    num_clients: int
    info: dict[str, Any]  # what models and engines read: "task", "dtype", "record_shape" (one record's shape), ...

    def client_data(self, client_id: int) -> ClientData:
        """Load (or generate) the partition of one client, deterministically."""

    def client_sizes(self) -> list[int]:
        """Number of training records of every client (public metadata: used for accounting)."""

    def eval_data(self) -> EvalData:
        """What the server evaluates on."""


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
