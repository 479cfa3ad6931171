"""Item 9 of issue 16: error messages name a record's index and its problem, never its values; a
private run's summary states the neighbouring relation, the threat model and what the guarantee
does not cover.

An error message is something the honest-but-curious server sees, and nothing privatises it: a
message that printed an eigenvalue or a label would release one record exactly.
"""

import re

import numpy as np
import pytest

from rfedray.config import load_config
from rfedray.ddpsa.mechanism import StaticClip
from rfedray.ddpsa.runner import run_ddpsa
from rfedray.ddpsa.secure_aggregation import LocalAggregators
from rfedray.data.arrays import ClassificationTask
from rfedray.data.validation import first_nonfinite, spd_problem
from rfedray.federated.loop import run_federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.engine import LocalEngine, TaskSpec
from rfedray.mestimation.runner import run_strategy
from rfedray.mestimation.strategies import FedSGD
from rfedray.privacy.statement import statement

TELLTALE = 7.654321  # a record value that no message may carry, in any rounding


def carries_a_value(message: str) -> bool:
    """Whether ``message`` holds a number other than the record's index (3) and the class count (4)."""
    return any(float(n) not in (3.0, 4.0) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", message))


def spd_records(edit):
    x = np.stack([np.eye(3) * (1 + i) for i in range(5)])
    edit(x[3])
    return x


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.__setitem__((0, 2), TELLTALE), "record 3 is not symmetric"),
    (lambda m: m.__setitem__((1, 1), -TELLTALE), "record 3 is singular or not positive definite"),
    (lambda m: m.__setitem__(slice(None), TELLTALE), "record 3 is singular or not positive definite"),
])
def test_a_covariance_problem_names_the_record_and_the_problem_only(edit, problem):
    message = spd_problem(spd_records(edit))
    assert message == problem and not carries_a_value(message)


def test_a_label_problem_names_the_record_and_the_allowed_range_only():
    y = np.array([0, 1, 2, 987654, 1])
    message = ClassificationTask.check_labels(y, {"num_classes": 4})
    assert message.startswith("record 3 has a label outside [0, 4)") and "987654" not in message


def test_a_non_finite_record_is_named_by_index():
    x = np.ones((5, 2))
    x[3, 1] = np.inf
    assert first_nonfinite(x) == "record 3 is not finite (inf)"


SMALL = ["run.rounds=2", "federation.n_clients=3", "federation.clients_per_round=2", "federation.local_steps=1",
         "federation.batch_size=20", "data.options.d=6", "data.options.p=2", "data.options.records_per_client=60",
         "monitoring.progress=false"]


def test_a_private_summary_states_the_relation_the_threat_model_and_what_is_not_covered(tmp_path):
    cfg = load_config(None, [*SMALL, f"run.output_dir={tmp_path}"])
    summary = run_federation(cfg, RunDirectory.create(str(tmp_path), "private"))
    assert summary["neighbouring_relation"].startswith("replace-one, record-level")
    assert summary["threat_model"].startswith("honest-but-curious server")
    not_covered = " ".join(summary["not_covered"])
    for gap in ("timing", "test-split evaluation", "oracle metrics", "uncovered variants", "seeded noise"):
        assert gap in not_covered
    assert {k: summary[k] for k in statement()} == statement()
    public = run_federation(load_config(None, [*SMALL, f"run.output_dir={tmp_path}", "privacy.enabled=false"]),
                            RunDirectory.create(str(tmp_path), "public"))
    assert "threat_model" not in public and public["private"] is False


def test_m_estimation_and_ddpsa_summaries_state_it_too():
    spec = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                    {"dataset": "synthetic_regression", "records_per_client": 200, "d": 3}, {"l2": 0.0}, 3, 0)
    dataset = spec.build_dataset()
    model = spec.build_model(dataset.info)
    newton = run_strategy(FedSGD(lr=0.5), LocalEngine(dataset, model), model, dataset, rounds=2, clients_per_round=2,
                          batch_size=50, epsilon=2.0, noise_seed=1)["summary"]
    ddpsa = run_ddpsa(StaticClip(0.3), LocalEngine(dataset, model), LocalAggregators(3), model, dataset, rounds=2,
                      clients_per_round=2, batch_size=50, lr=0.5, epsilon=2.0, noise_seed=0, patience=2)["summary"]
    for summary in (newton, ddpsa):
        assert {k: summary[k] for k in statement()} == statement()
