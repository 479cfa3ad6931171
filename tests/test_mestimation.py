"""Private federated M-estimation: data, models, Hessians, strategies, accounting, engines, CLI."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from rfedray.data import sklearn_data, vision
from rfedray.federated.engine import LocalEngine, TaskSpec
from rfedray.mestimation.local import VmapHessian, newton_direction, private_hessian
from rfedray.mestimation.runner import pooled_m_estimator, run_strategy
from rfedray.mestimation.strategies import FedAvg, FedHybrid, FedNewton, FedSGD
from rfedray.privacy.mechanism import noise_generator
from rfedray.models.logreg import LogisticRegression, build as build_glm, Options as GLMOptions
from rfedray.models.mlp import MLP

SPEC = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                {"dataset": "synthetic_logistic", "records_per_client": 1500, "d": 5, "partition": "iid"},
                {"l2": 1e-2}, 3, 0)


@pytest.fixture(scope="module")
def task():
    dataset = SPEC.build_dataset()
    model = SPEC.build_model(dataset.info)
    return dataset, model, pooled_m_estimator(model, dataset.pooled_train())


def test_digits_partition_is_a_partition_and_dirichlet_is_skewed():
    ds = sklearn_data.build(sklearn_data.Options(dataset="digits", partition="dirichlet", alpha=0.1), n_clients=5, seed=0)
    sizes = ds.client_sizes()
    assert sum(sizes) == len(ds.arrays.x_train) and min(sizes) >= 1
    labels = [set(ds.client_data(i).train[1].tolist()) for i in range(5)]
    assert min(len(s) for s in labels) < 10
    x, _ = ds.client_data(0).train
    assert torch.allclose(x.norm(dim=1), torch.ones(len(x), dtype=x.dtype))
    assert ds.info["num_classes"] == 10 and ds.eval_data().tensors[0].shape[1] == 64


def test_data_options_are_validated():
    with pytest.raises(ValueError, match="data.options.dataset"):
        sklearn_data.build(sklearn_data.Options(dataset="iris"), n_clients=2, seed=0)
    with pytest.raises(ValueError, match="n_clients"):
        sklearn_data.partition_indices(5, 10, np.random.default_rng(0))


def _write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + b"".join(struct.pack(">I", s) for s in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_vision_loaders_read_standard_files_and_explain_missing_ones(tmp_path):
    with pytest.raises(vision.DatasetNotFoundError, match="'mnist'.*looked in.*download"):
        vision.build(vision.Options(dataset="mnist", root=str(tmp_path)), n_clients=2, seed=0).client_sizes()
    rng = np.random.default_rng(0)
    for name, shape in (("train-images-idx3-ubyte", (40, 28, 28)), ("t10k-images-idx3-ubyte", (10, 28, 28))):
        _write_idx(tmp_path / f"{name}.gz", rng.integers(0, 256, shape))
    for name, n in (("train-labels-idx1-ubyte", 40), ("t10k-labels-idx1-ubyte", 10)):
        _write_idx(tmp_path / f"{name}.gz", rng.integers(0, 10, n))
    ds = vision.build(vision.Options(dataset="mnist", root=str(tmp_path)), n_clients=4, seed=0)
    assert ds.client_sizes() == [10, 10, 10, 10] and ds.client_data(0).train[0].shape == (10, 784)
    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    for name in (*vision.CIFAR_TRAIN, vision.CIFAR_TEST):
        with open(cifar / name, "wb") as fh:
            pickle.dump({b"data": rng.integers(0, 256, (6, 3072)).astype(np.uint8), b"labels": list(range(6))}, fh)
    ds = vision.build(vision.Options(dataset="cifar10", root=str(tmp_path)), n_clients=3, seed=0)
    assert sum(ds.client_sizes()) == 30 and ds.eval_data().tensors[0].shape == (6, 3072)


@pytest.mark.parametrize("dataset", ["digits", "diabetes"])
def test_closed_form_glm_hessians_match_vmap(dataset):
    ds = sklearn_data.build(sklearn_data.Options(dataset=dataset), n_clients=4, seed=0)
    model = build_glm(GLMOptions(l2=0.05), ds.info)
    gen = torch.Generator().manual_seed(0)
    params = {k: 0.3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in model.init_params(gen).items()}
    x, y = ds.client_data(1).train
    x, y = x[:12], y[:12]
    w = torch.rand(12, generator=gen, dtype=torch.float64)
    ref = VmapHessian(model.per_sample_loss, params, chunk_size=5)
    assert torch.allclose(model.weighted_hessian_sum(params, w, x, y), ref.weighted_hessian_sum(params, w, x, y), atol=1e-12)
    assert torch.allclose(model.per_sample_hessian_norms(params, x, y), ref.per_sample_hessian_norms(params, x, y), atol=1e-12)


def test_private_hessian_clips_each_record_and_stays_symmetric():
    model = MLP(3, [4], 1, task="regression")
    params = model.init_params(torch.Generator().manual_seed(0))
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    gen = noise_generator(1)
    tiny = private_hessian(model, params, (x, y), clip=1e-3, sigma=1e-9, generator=gen)
    assert torch.allclose(tiny, tiny.mT) and float(torch.linalg.matrix_norm(tiny)) <= 1e-3 + 1e-6
    exact = private_hessian(model, params, (x, y), clip=1.0, sigma=None, generator=gen)
    flat = torch.func.hessian(lambda v: torch.stack([model.per_sample_loss(VmapHessian(model.per_sample_loss, params).layout.unflatten(v), a, b) for a, b in zip(x, y)]).mean())
    assert torch.allclose(exact, flat(VmapHessian(model.per_sample_loss, params).layout.flatten(params)), atol=1e-10)
    direction = newton_direction(-torch.eye(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), floor=0.5)
    assert torch.allclose(direction, 2 * torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="floor"):
        newton_direction(torch.eye(2), torch.ones(2), floor=0.0)


def _run(task, strategy, rounds, **privacy):
    dataset, model, ref = task
    return run_strategy(strategy, LocalEngine(dataset, model), model, dataset, rounds=rounds, clients_per_round=3,
                        batch_size=1500, reference=ref, **privacy)


def test_nonprivate_claims_newton_fast_and_hybrid_less_biased_than_fedavg(task):
    newton = _run(task, FedNewton(floor=1e-3), 3)["history"]
    sgd = _run(task, FedSGD(lr=4.0), 30)["history"]
    assert newton[2]["oracle_error"] < 0.02 and newton[2]["oracle_error"] < sgd[-1]["oracle_error"]
    avg = _run(task, FedAvg(10, 4.0), 12)["history"][-1]["oracle_error"]
    hybrid = _run(task, FedHybrid(FedAvg(10, 4.0), FedSGD(4.0), 4), 12)["history"][-1]["oracle_error"]
    assert hybrid < avg


def test_private_run_charges_every_step_and_halts_at_the_target(task):
    result = _run(task, FedAvg(5, 2.0), 4, epsilon=2.0, noise_seed=3)
    s = result["summary"]
    assert s["private_steps_per_client"] == 20 and s["epsilon_spent"] <= 2.0 + 1e-6 and s["epsilon_spent"] > 1.5
    assert not s["halted"] and s["not_for_production"]
    halted = _run(task, FedSGD(2.0), 6, epsilon=0.5, noise_multiplier=0.002, noise_seed=3)["summary"]
    assert halted["halted"] and halted["rounds_completed"] < 6


def test_newton_pair_costs_one_step(task):
    newton = _run(task, FedNewton(floor=0.05), 2, epsilon=4.0, noise_seed=0)["summary"]
    sgd = _run(task, FedSGD(1.0), 2, epsilon=4.0, noise_seed=0)["summary"]
    assert newton["noise_multiplier"] == pytest.approx(sgd["noise_multiplier"])
    assert newton["epsilon_spent"] == pytest.approx(sgd["epsilon_spent"])


def test_strategy_arguments_are_checked():
    with pytest.raises(ValueError, match="lr"):
        FedSGD(lr=0)
    with pytest.raises(ValueError, match="local_steps"):
        FedAvg(local_steps=0)
    with pytest.raises(ValueError, match="damping"):
        FedNewton(damping=2.0)
    with pytest.raises(ValueError, match="max_params"):
        FedNewton(max_params=10).check_model(LogisticRegression(64, 10).init_params(None))


def test_cli_runs_a_config(tmp_path, capsys):
    from rfedray.config import ConfigError
    from rfedray.mestimation.config import MEstimationConfig, load
    import argparse
    from rfedray.mestimation import commands

    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["mestimation", "run", "configs/mestimation_digits.yaml", f"run.output_dir={tmp_path}",
                              "run.rounds=1", "federation.batch_size=50"])
    assert args.func(args) == 0
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "summary.json").is_file() and (run_dir / "metrics.jsonl").is_file()
    with pytest.raises(ConfigError, match="strategy.name"):
        load(MEstimationConfig, None, ["strategy.name=newton"])
    with pytest.raises(ConfigError, match="federation.clients_per_round"):
        load(MEstimationConfig, None, ["federation.clients_per_round=9"])


@pytest.mark.slow
def test_ray_engine_matches_local(task):
    from actors.engine import ray_task_engine

    dataset, model, ref = task
    engine = ray_task_engine(SPEC, SPEC.n_clients, num_hosts=2)
    try:
        ray_run = run_strategy(FedSGD(2.0), engine, model, dataset, rounds=3, clients_per_round=3, batch_size=100,
                               epsilon=4.0, noise_seed=5, reference=ref)
    finally:
        engine.close()
    local = run_strategy(FedSGD(2.0), LocalEngine(dataset, model), model, dataset, rounds=3, clients_per_round=3,
                         batch_size=100, epsilon=4.0, noise_seed=5, reference=ref)
    for k in local["theta"]:
        assert torch.equal(ray_run["theta"][k], local["theta"][k])  # the same bits: answers in cohort order


@pytest.mark.slow
def test_ray_task_engine_restarts_hosts_and_keeps_the_deadline(task):
    """The M-estimation engine has the main engine's fault handling: a host actor that dies for good
    makes its clients dropouts of that round and is re-created for the next (whose answers are the
    local engine's bits); a host that misses the round deadline makes its clients dropouts."""
    import ray

    from actors.engine import ray_task_engine
    from rfedray.federated.client import ClientFailure
    from rfedray.mestimation.local import StepPlan
    from rfedray.mestimation.strategies import GradientTask

    dataset, model, _ = task
    theta = model.init_params(torch.Generator().manual_seed(0))
    gradient = GradientTask(StepPlan(100, 1.0, 0.5, noise_seed=3))
    cohort = [2, 0, 1]
    local = LocalEngine(dataset, model).run(cohort, gradient, theta, 1)
    engine = ray_task_engine(SPEC, SPEC.n_clients, num_hosts=2, timeout_s=60.0)
    try:
        assert engine.pool.blocks == [[0, 1], [2]]
        ray.kill(engine.pool.actors[0], no_restart=True)
        lost = engine.run(cohort, gradient, theta, 0)
        assert list(lost) == cohort
        assert [type(lost[c]).__name__ for c in cohort] == ["dict", "ClientFailure", "ClientFailure"]
        assert lost[0].reason == "its client actor died"
        again = engine.run(cohort, gradient, theta, 1)
        for c in cohort:
            assert not isinstance(again[c], ClientFailure), again[c]
            assert all(torch.equal(again[c][k], local[c][k]) for k in local[c])
        engine.calls.timeout_s = 0.0  # every call misses the deadline
        late = engine.run(cohort, gradient, theta, 2)
        assert all(isinstance(late[c], ClientFailure) and "round_timeout_s" in late[c].reason for c in cohort)
    finally:
        engine.close()
