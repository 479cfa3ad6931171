"""Evaluation of the global model: where the test records are, and what the server learns of them.

``run.test_set`` chooses one of two evaluations, once, when the run starts:

* ``clients`` (:class:`ClientTestEvaluation`, the default): every client evaluates theta on its own
  test split, in the process that hosts it, and the server learns only a secure-aggregated sum over
  the clients that answered. Client ``i`` with ``n_i`` test records and metrics ``m_i`` (the
  model's :meth:`~rfedray.task.FederatedModel.evaluate` on its split) encodes the vector::

      s_i = (n_i,  n_i m_i[k] for every metric k,  [m_i[k] unusable] for every metric k)

  (a metric is unusable when it is not finite or beyond the codec's range; it then counts 0 in
  the sums), secret-shares it over the aggregators of :mod:`rfedray.ddpsa.secure_aggregation`
  (the project's secure aggregation, DDP-SA's), and returns only the names of its metrics. The
  server decodes ``sum_i s_i`` and reports ``m[k] = sum_i n_i m_i[k] / sum_i n_i``: the
  record-weighted mean of the clients' metrics, which for a metric that is a mean over records
  (``accuracy``: ``n_i m_i`` is the client's count of correct records; ``loss``: its loss sum) is
  exactly the metric of the union of the test splits. Counts decode exactly; each sum is within
  ``n / 2^(frac_bits + 1)`` of the plain sum over ``n`` clients. The aggregators refuse a sum over
  fewer than :data:`MIN_CLIENTS` clients: with fewer the round's evaluation is skipped (the record
  says ``evaluated_clients: 0``), so that no single client's test result is ever visible to the
  server. The server process never loads a client's records.
* ``server`` (:class:`ServerTestEvaluation`): the server evaluates on what the data source gives it
  (:meth:`~rfedray.task.FederatedDataset.eval_data`), loaded in the server process: a test set
  the server holds (scikit-learn sources, the arrays source's ``x_test``, MNIST/CIFAR's official
  test split), a simulation oracle computed from the training records (synthetic federated PCA's
  pooled covariance, metrics named ``oracle_*``), or, for EEG, the union of the clients' test splits
  (a simulation choice: the server process then loads them).

Neither evaluation is covered by the privacy guarantee of training (:mod:`rfedray.privacy.statement`):
a metric of test records is a release about those records.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence

import numpy as np

from rfedray.ddpsa.secure_aggregation import AggregatorGroup, FixedPointCodec, collect_sum, send_update
from rfedray.task import EvalData, FederatedModel, Params

log = logging.getLogger(__name__)

MIN_CLIENTS = 2
"""Fewest clients a secure-aggregated evaluation sums (one alone would be its own test result)."""

NUM_AGGREGATORS = 2
"""Aggregators the clients' shares go to (the fewest the additive sharing allows)."""


@dataclass(frozen=True)
class Evaluated:
    """One round's evaluation as the loop records it.

    Attributes
    ----------
    metrics : dict or None
        The metrics (``None``: this round has none, the run keeps its last ones).
    fields : dict
        What the round's record says about the evaluation itself (e.g. ``evaluated_clients``).
    """

    metrics: Optional[dict[str, float]]
    fields: dict[str, Any] = field(default_factory=dict)


class Evaluation(Protocol):
    """How the loop evaluates theta (chosen once by ``run.test_set``)."""

    oracle: bool  # its metrics are those of an oracle (``oracle_*``)

    def evaluate(self, theta: Params, round_index: int) -> Evaluated: ...


def evaluation_vector(records: int, metrics: Mapping[str, float], codec: FixedPointCodec) -> tuple[tuple[str, ...], np.ndarray]:
    """A client's evaluation as the vector it secret-shares.

    Parameters
    ----------
    records : int
        ``n_i``, the client's test records.
    metrics : mapping
        ``m_i``, the model's metrics on them.
    codec : FixedPointCodec
        Whose range decides which ``n_i m_i[k]`` are encodable.

    Returns
    -------
    names : tuple of str
        The metrics' names, sorted: the layout of the vector.
    vector : ndarray, shape ``(1 + 2 K,)``
        ``(n_i, n_i m_i[k]..., unusable_k...)`` for the ``K`` metrics, float64.
    """
    names = tuple(sorted(metrics))
    scaled = np.array([records * float(metrics[k]) for k in names], dtype=np.float64)
    unusable = ~np.isfinite(scaled) | (np.abs(np.nan_to_num(scaled, nan=0.0)) > codec.max_abs)
    return names, np.concatenate([[float(records)], np.where(unusable, 0.0, scaled), unusable.astype(np.float64)])


def metrics_of_sum(names: Sequence[str], total: np.ndarray) -> dict[str, float]:
    """The metrics of a decoded sum of :func:`evaluation_vector` vectors: ``sum n m[k] / sum n`` each, ``nan``
    for a metric some client could not encode."""
    k = len(names)
    records, sums, unusable = total[0], total[1:1 + k], total[1 + k:]
    return {name: float(s / records) if u == 0 else float("nan") for name, s, u in zip(names, sums, unusable)}


@dataclass(frozen=True)
class EvaluationTask:
    """The client side of :class:`ClientTestEvaluation` (picklable: the group is local objects or
    actor handles). Runs where the client is hosted; what leaves it is shares and metric names."""

    codec: FixedPointCodec
    aggregators: AggregatorGroup

    def __call__(self, client, theta: Params, round_index: int) -> Optional[tuple[str, ...]]:
        """Evaluate ``client`` (a :class:`~rfedray.federated.client.Client`) on its test split and
        send the shares of :func:`evaluation_vector`; its metrics' names, or ``None`` without a test split."""
        evaluated = client.evaluate_test(theta)
        if evaluated is None:
            return None
        names, vector = evaluation_vector(*evaluated, self.codec)
        send_update(self.aggregators, self.codec, round_index, client.client_id, vector)
        return names


class ClientTestEvaluation:
    """Every client evaluates on its own test split; the server learns the secure-aggregated sum only.

    Holds no records and no data source: the server process loads nothing to evaluate.

    Parameters
    ----------
    hosts : Executor
        The engine (:class:`~rfedray.federated.executor.Executor`): its ``run`` runs the task where
        each client is hosted, and its ``share_aggregators`` receive the shares.
    n_clients : int
        Clients of the federation (the codec's ``max_parties``).
    """

    oracle = False

    def __init__(self, hosts, n_clients: int):
        self.hosts, self.n_clients = hosts, n_clients
        self._no_test_splits = False
        self.codec = FixedPointCodec(max_parties=max(1, n_clients))
        self._task: Optional[EvaluationTask] = None
        self._skipped = False  # warned once; later skipped rounds are logged at debug level

    def evaluate(self, theta: Params, round_index: int) -> Evaluated:
        if self._no_test_splits:
            return Evaluated(None, {"evaluated_clients": 0})
        if self._task is None:
            self._task = EvaluationTask(self.codec, self.hosts.share_aggregators())
        answers = self.hosts.run(range(self.n_clients), self._task, theta, round_index)
        # Every client answered that it holds no test split: none ever will (the data are fixed).
        self._no_test_splits = len(answers) == self.n_clients and all(a is None for a in answers.values())
        layouts = {cid: a for cid, a in sorted(answers.items()) if isinstance(a, tuple)}
        names = Counter(layouts.values()).most_common(1)[0][0] if layouts else ()
        among = [cid for cid, layout in layouts.items() if layout == names]
        if len(among) < len(layouts):
            log.warning("round %d: %d clients evaluated other metrics than %s: left out of the evaluation",
                        round_index, len(layouts) - len(among), list(names))
        result = collect_sum(self._task.aggregators, self.codec, round_index, MIN_CLIENTS, among=among)
        if result.total is None:
            say = log.debug if self._skipped else log.warning  # once a run; later rounds' records say it
            say("round %d: evaluation skipped: %d client(s) evaluated a test split, at least %d are needed so that "
                "no client's test result is visible alone (a data source without client test splits needs "
                "run.test_set=server)", round_index, len(result.participants), MIN_CLIENTS)
            self._skipped = True
            return Evaluated(None, {"evaluated_clients": 0})
        return Evaluated(metrics_of_sum(names, result.total), {"evaluated_clients": len(result.participants)})


class ServerTestEvaluation:
    """The server evaluates on the data source's :meth:`~rfedray.task.FederatedDataset.eval_data`,
    loaded in the server process when the run starts (a bad input fails there).

    Parameters
    ----------
    model : FederatedModel
    data : EvalData
    """

    def __init__(self, model: FederatedModel, data: EvalData):
        self.model, self.data = model, data
        self.oracle = data.oracle

    def evaluate(self, theta: Params, round_index: int) -> Evaluated:
        if not self.data.tensors:
            return Evaluated(None)
        return Evaluated(self.data.labelled(self.model.evaluate(theta, self.data)))


TEST_SETS = {
    "clients": lambda fed, hosts: ClientTestEvaluation(hosts, fed.cfg.federation.n_clients),
    "server": lambda fed, hosts: ServerTestEvaluation(fed.model, fed.dataset.eval_data()),
}
"""The evaluation of each ``run.test_set`` (a :class:`~rfedray.federated.loop.Federation` and its
engine in, an :class:`Evaluation` out; the config checks the name)."""
