"""Evaluation where the test records are (issue 16, item 4): every client evaluates theta on its own
test split and the server learns only the secure-aggregated sum (rfedray/federated/evaluation.py).

* the secure sum is the plain sum (counts exactly, sums to the codec's resolution), and the
  metrics are those of the union of the test splits (accuracy to the bit);
* fewer than two answering clients: no sum, the round's evaluation is skipped and says so;
* the server process never loads a client's records, on either engine, and both engines give the
  same metrics to the bit;
* ``run.test_set`` is checked; ``server`` evaluates on the data source's server-side data.
"""

import importlib
import json
import logging
import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from test_ray_engine import start_test_ray

import rfedray
from rfedray.cli import main
from rfedray.config import ConfigError, load_config
from rfedray.ddpsa.secure_aggregation import LocalAggregators, collect_sum, field_sum
from rfedray.federated.evaluation import (
    MIN_CLIENTS, ClientTestEvaluation, EvaluationTask, ServerTestEvaluation, evaluation_vector, metrics_of_sum,
)
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import initial_params

SPDNET = [
    "model.name=spdnet", "model.options.d=4", "data.source=synthetic_eeg", "data.options.channels=8",
    "data.options.trials_per_client=24", "federation.n_clients=4", "federation.clients_per_round=2",
    "federation.local_steps=2", "federation.batch_size=6", "run.rounds=3", "privacy.epsilon=8", "privacy.clip=1.0",
    "privacy.noise_seed=12", "optim.default.lr=0.05", "monitoring.progress=false",
]


def federation(tmp_path, *overrides) -> Federation:
    cfg = load_config(None, [*SPDNET, f"run.output_dir={tmp_path}", *overrides])
    return Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "x"))


class SomeClients:
    """The local executor's clients, only those of ``client_ids`` answering."""

    def __init__(self, executor, client_ids):
        self.executor, self.client_ids = executor, client_ids

    def run(self, cohort, task, theta, round_index):
        return self.executor.run([cid for cid in cohort if cid in self.client_ids], task, theta, round_index)

    def share_aggregators(self):
        return self.executor.share_aggregators()


def test_the_secure_sum_is_the_plain_sum_and_the_metrics_are_the_union_of_the_test_splits(tmp_path):
    fed = federation(tmp_path)
    executor = fed.local_executor()
    theta = initial_params(fed.cfg, fed.model)
    evaluation = ClientTestEvaluation(executor, 4)

    plain = {cid: executor.client(cid).evaluate_test(theta) for cid in range(4)}
    vectors = [evaluation_vector(n, metrics, evaluation.codec)[1] for n, metrics in plain.values()]
    group = LocalAggregators(2)
    task = EvaluationTask(evaluation.codec, group)
    names = {task(executor.client(cid), theta, 0) for cid in range(4)}
    assert names == {("accuracy", "loss")}  # all a client returns: the names; the values went as shares
    secure = collect_sum(group, evaluation.codec, 0)
    plain_sum = np.sum(vectors, axis=0)
    assert secure.participants == [0, 1, 2, 3]
    assert secure.total[0] == plain_sum[0] == sum(n for n, _ in plain.values())  # the record count, exactly
    correct = [round(n * m["accuracy"]) for n, m in plain.values()]
    assert secure.total[1] == sum(correct)  # the correct count, exactly
    assert np.abs(secure.total - plain_sum).max() <= 4 * evaluation.codec.resolution

    evaluated = evaluation.evaluate(theta, 1)
    union = fed.model.evaluate(theta, fed.dataset.eval_data())
    assert evaluated.fields == {"evaluated_clients": 4}
    assert evaluated.metrics["accuracy"] == union["accuracy"]  # to the bit
    assert evaluated.metrics["loss"] == pytest.approx(union["loss"], rel=1e-7)


def test_one_answering_client_is_never_visible_alone(tmp_path, caplog):
    fed = federation(tmp_path)
    executor = fed.local_executor()
    theta = initial_params(fed.cfg, fed.model)
    alone = ClientTestEvaluation(SomeClients(executor, [2]), 4)
    with caplog.at_level(logging.WARNING):
        skipped = alone.evaluate(theta, 0)
    assert MIN_CLIENTS == 2 and skipped.metrics is None and skipped.fields == {"evaluated_clients": 0}
    assert "evaluation skipped: 1 client(s) evaluated a test split, at least 2 are needed" in caplog.text
    assert all(not a.received(0) for a in executor.share_aggregators().aggregators)  # its shares discarded

    pair = ClientTestEvaluation(SomeClients(executor, [1, 3]), 4).evaluate(theta, 1)
    (n1, m1), (n3, m3) = executor.client(1).evaluate_test(theta), executor.client(3).evaluate_test(theta)
    assert pair.fields == {"evaluated_clients": 2}
    assert pair.metrics["accuracy"] == (round(n1 * m1["accuracy"]) + round(n3 * m3["accuracy"])) / (n1 + n3)


def test_a_metric_that_cannot_be_encoded_is_reported_as_nan():
    codec = ClientTestEvaluation(None, 4).codec
    names, a = evaluation_vector(10, {"loss": float("inf"), "accuracy": 0.5}, codec)
    _, b = evaluation_vector(30, {"loss": 0.25, "accuracy": 0.1}, codec)
    _, c = evaluation_vector(30, {"loss": 2 * codec.max_abs, "accuracy": 0.1}, codec)
    codec.encode(a), codec.encode(c)  # encodable: the unusable values count 0 and are flagged
    metrics = metrics_of_sum(names, codec.decode(field_sum([codec.encode(a), codec.encode(b)])))
    assert metrics["accuracy"] == pytest.approx((5 + 3) / 40) and np.isnan(metrics["loss"])
    assert metrics_of_sum(names, b)["loss"] == 0.25


def test_run_test_set_is_checked_and_server_evaluates_on_the_servers_data(tmp_path, capsys):
    with pytest.raises(ConfigError, match="run.test_set"):
        load_config(None, ["run.test_set=both"])
    assert main(["config", "show", "run.test_set=both"]) == 2
    assert capsys.readouterr().err.startswith("error: run.test_set='both': must be one of clients, server")
    fed = federation(tmp_path, "run.test_set=server")
    evaluation = ServerTestEvaluation(fed.model, fed.dataset.eval_data())
    theta = initial_params(fed.cfg, fed.model)
    assert evaluation.evaluate(theta, 0).metrics == fed.model.evaluate(theta, fed.dataset.eval_data())


MARKED = '''
import os
from pathlib import Path

from rfedray.data.synthetic_eeg import Options, SyntheticEEG


class MarkedEEG(SyntheticEEG):
    """Synthetic EEG that leaves a mark naming the process that loads a client's records or the server's data."""

    def __init__(self, marks, n_clients, seed):
        super().__init__(Options(channels=8, trials_per_client=24), n_clients=n_clients, seed=seed)
        self.marks = marks

    def client_data(self, client_id):
        Path(self.marks, f"client-{client_id}-{os.getpid()}").touch()
        return super().client_data(client_id)

    def eval_data(self):
        Path(self.marks, f"eval-{os.getpid()}").touch()
        return super().eval_data()
'''


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    """A data class only this process can import (rfedray ships it to the actors)."""
    folder = tmp_path_factory.mktemp("marked")
    name = f"marked_eeg_{secrets.token_hex(4)}"
    (folder / f"{name}.py").write_text(MARKED)
    sys.path.insert(0, str(folder))
    yield importlib.import_module(name)
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def ray_instance():
    start_test_ray()
    yield
    ray.shutdown()


def marks_of(folder: Path) -> tuple[dict[int, set[int]], set[int]]:
    """Process ids that loaded each client, and those that loaded the server's data (the marks cleared)."""
    clients, server = {}, set()
    for mark in folder.iterdir():
        kind, *rest = mark.name.split("-")
        if kind == "client":
            clients.setdefault(int(rest[0]), set()).add(int(rest[1]))
        else:
            server.add(int(rest[0]))
        mark.unlink()
    return clients, server


def test_the_server_process_loads_no_records_and_both_engines_give_the_same_metrics(marked, ray_instance, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    common = [*SPDNET[:2], *SPDNET[5:], "ray.num_client_actors=2", "ray.num_cpus_per_actor=0.5"]
    local = rfedray.run(None, *common, f"run.output_dir={tmp_path}", dataset=marked.MarkedEEG(str(marks), 4, 0),
                        engine="local", quiet=True)
    clients, server = marks_of(marks)
    assert not server and set(clients) == {0, 1, 2, 3}  # the local engine's clients, in this process
    assert [r["evaluated_clients"] for r in local.metrics] == [4, 4, 4]

    on_ray = rfedray.run(None, *common, f"run.output_dir={tmp_path}", dataset=marked.MarkedEEG(str(marks), 4, 0),
                         engine="ray", quiet=True)
    clients, server = marks_of(marks)
    placement = json.loads((on_ray.run_dir / "placement.json").read_text())
    host = {client: actor["pid"] for actor in placement["client_actors"] for client in actor["clients"]}
    assert not server  # the server process never loaded evaluation data ...
    assert clients == {client: {pid} for client, pid in host.items()}  # ... nor any client: each loaded where hosted
    assert placement["server"]["pid"] not in host.values() and os.getpid() not in host.values()

    evaluated = lambda result: [{k: v for k, v in r.items() if k.startswith("metric_") or k == "evaluated_clients"}  # noqa: E731
                                for r in result.metrics]
    assert evaluated(on_ray) == evaluated(local) and "metric_accuracy" in evaluated(local)[-1]  # the same bits
    for group, value in local.final_params.items():
        assert torch.equal(on_ray.final_params[group], value), group
