"""The server defends the model: a client that sends garbage every round is rejected and counted.

The garbage client is a test executor wrapping the local one (actors/ offers no hook to corrupt a
client actor's answer): whenever client ``BAD`` is in the cohort its submission is replaced by
garbage of a kind that changes every round. Every garbage submission must be rejected, logged and
counted (``metrics.jsonl``, ``summary.json``, ``rfedray_submissions_rejected_total``), the other
clients' rounds must go on, and theta must stay finite and on the manifold throughout.
"""

import logging

import pytest
import torch

from rfedray.config import load_config
from rfedray.federated.client import LocalResult
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.server import Server
from rfedray.observers import MetricsObserver

BAD = 1
SMALL = [
    "run.engine=local", "run.rounds=16", "federation.n_clients=4", "federation.clients_per_round=3",
    "federation.local_steps=2", "federation.batch_size=20", "data.options.d=8", "data.options.p=2",
    "data.options.records_per_client=100", "privacy.sigma=0.05", "privacy.epsilon=null", "privacy.noise_seed=3",
    "monitoring.progress=false", "monitoring.metrics_port=0", "run.test_set=server",  # the oracle gap
]

GARBAGE = {
    "nan": lambda theta: {k: torch.full_like(v, float("nan")) for k, v in theta.items()},
    "inf": lambda theta: {k: v.clone().fill_(float("inf")) for k, v in theta.items()},
    "one-nan-entry": lambda theta: {k: torch.where(torch.arange(v.numel()).reshape(v.shape) == 0, float("nan"), v)
                                    for k, v in theta.items()},
    "wrong-shape": lambda theta: {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in theta.items()},
    "missing-group": lambda theta: {},
    "extra-group": lambda theta: {**theta, "intruder": torch.zeros(3)},
    "not-a-tensor": lambda theta: {k: v.tolist() for k, v in theta.items()},
    "not-a-mapping": lambda theta: [v for v in theta.values()],
    "huge": lambda theta: {k: torch.full_like(v, 1e30) for k, v in theta.items()},
    "far-from-manifold": lambda theta: {k: v * 1e6 for k, v in theta.items()},
    "integer": lambda theta: {k: torch.ones(v.shape, dtype=torch.int64) for k, v in theta.items()},
    "complex": lambda theta: {k: v.to(torch.complex64) * 1j for k, v in theta.items()},
}
KINDS = list(GARBAGE)


class GarbageExecutor:
    """The local executor, except that client ``bad`` answers garbage every round it is selected."""

    def __init__(self, inner, bad: int):
        self.inner, self.bad = inner, bad
        self.sent: list[tuple[int, str]] = []
        self.thetas: list[dict] = []

    def train(self, cohort, theta, round_index, states):
        self.thetas.append({k: v.clone() for k, v in theta.items()})
        results = self.inner.train(cohort, theta, round_index, states)
        if self.bad in results:
            kind = KINDS[len(self.sent) % len(KINDS)]
            results[self.bad] = LocalResult(GARBAGE[kind](theta), {"poison": torch.full((2,), float("nan"))}, 0.0)
            self.sent.append((round_index, kind))
        return results

    def close(self):
        self.inner.close()


def run_with_garbage(tmp_path, *extra):
    cfg = load_config(None, [*SMALL, f"run.output_dir={tmp_path}", *extra])
    rd = RunDirectory.create(str(tmp_path), "garbage")
    fed = Federation.prepare(cfg, rd)
    observer = MetricsObserver(cfg, rd.run_id, fed.privacy.sigma)
    fed.observers.append(observer)
    executor = GarbageExecutor(fed.local_executor(), BAD)
    try:
        summary = fed.run(executor)
    finally:
        executor.close()
        observer.metrics.close()
    return fed, rd, summary, executor, observer.metrics


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_garbage_is_refused_with_a_reason(kind):
    from rfedray.aggregation import SCHEMES
    from rfedray.geometry import Grassmann, ProductManifold

    theta = {"subspace": Grassmann(6, 2).random_point(generator=torch.Generator().manual_seed(0))}
    server = Server(ProductManifold({"subspace": Grassmann(6, 2)}), SCHEMES["projavg"]())
    assert server.check_submission(theta, theta) is None
    assert server.check_submission(theta, GARBAGE[kind](theta)) is not None
    new, rejected = server.aggregate(theta, {0: GARBAGE[kind](theta), 1: theta})
    assert [r.client_id for r in rejected] == [0]
    assert torch.isfinite(new["subspace"]).all()


def test_garbage_client_is_rejected_counted_and_the_round_goes_on(tmp_path, caplog):
    from rfedray.geometry import Grassmann

    with caplog.at_level(logging.WARNING, logger="rfedray.federated.rounds"):
        fed, rd, summary, executor, metrics = run_with_garbage(tmp_path)
    sent = executor.sent
    assert len(sent) >= len(KINDS) // 2 and summary["rounds_completed"] == 16
    # counted everywhere, exactly once per garbage submission
    assert summary["submissions_rejected"] == len(sent)
    rounds = [r for r in rd.read_metrics() if "event" not in r]
    by_round = {r["round"]: r for r in rounds}
    for t, _ in sent:
        assert by_round[t]["rejected"] == 1
        assert by_round[t]["answered"] == by_round[t]["cohort_size"] - 1
    assert sum(r["rejected"] for r in rounds) == len(sent)
    labels = metrics.labels
    assert metrics.registry.get_sample_value("rfedray_submissions_rejected_total", labels) == len(sent)
    # one log line per rejection, saying why
    lines = [r.getMessage() for r in caplog.records if "submission rejected" in r.getMessage()]
    assert len(lines) == len(sent)
    # theta never became non-finite and stayed on the manifold, and the honest clients still learned
    manifold = Grassmann(8, 2)
    final = torch.load(rd.final_model)["subspace"]
    for theta in [*executor.thetas, {"subspace": final}]:
        assert torch.isfinite(theta["subspace"]).all()
        assert float(manifold.distance_to_manifold(theta["subspace"].double())) < 1e-5
    assert summary["final_metrics"]["oracle_gap"] < 0.5 * executor_gap_at_start(fed)


def executor_gap_at_start(fed):
    from rfedray.federated.setup import initial_params

    return fed.model.evaluate(initial_params(fed.cfg, fed.model), fed.dataset.eval_data())["gap"]


def test_a_federation_of_one_garbage_client_keeps_its_model(tmp_path):
    fed, rd, summary, executor, metrics = run_with_garbage(
        tmp_path, "federation.n_clients=2", "federation.clients_per_round=1", "run.rounds=6",
    )
    only_garbage = {t for t, _ in executor.sent}
    thetas = executor.thetas
    for t in only_garbage:
        if t + 1 < len(thetas):
            assert torch.equal(thetas[t]["subspace"], thetas[t + 1]["subspace"]), f"round {t} changed theta"
    assert summary["submissions_rejected"] == len(only_garbage) > 0
    assert torch.isfinite(torch.load(rd.final_model)["subspace"]).all()
