"""DDP-SA(-adaptive): Laplace accountant, layer-wise clipping policies, the federation with secure sums."""

import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution

from rfedray.privacy.accountants import LaplaceAccountant, LaplaceStep
from rfedray.privacy.pld import subsampled_laplace_pld
from rfedray.ddpsa.mechanism import MedianClip, PrivateQuantileClip, StaticClip, ddpsa_step, laplace_noise, layers_of
from rfedray.ddpsa.runner import run_ddpsa
from rfedray.ddpsa.secure_aggregation import LocalAggregators
from rfedray.federated.engine import LocalEngine, TaskSpec
from rfedray.privacy.mechanism import noise_generator

SPEC = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                {"dataset": "synthetic_regression", "records_per_client": 200, "d": 5}, {"l2": 0.0}, 4, 0)


@pytest.mark.parametrize("ratio,steps", [(1.0, 1), (0.5, 10), (2.0, 3)])
def test_unsampled_laplace_pld_matches_dp_accounting(ratio, steps):
    ours = subsampled_laplace_pld(ratio, 1.0).self_compose(steps).epsilon(1e-5)
    ref = privacy_loss_distribution.from_laplace_mechanism(
        parameter=1.0, sensitivity=ratio, value_discretization_interval=1e-4).self_compose(steps).get_epsilon_for_delta(1e-5)
    assert ours == pytest.approx(ref, rel=1e-3, abs=1e-3)


def test_subsampled_laplace_is_symmetrised_hence_above_one_direction():
    pld = subsampled_laplace_pld(0.5, 0.05)
    assert pld.probs.sum() == pytest.approx(1.0, abs=1e-9) and pld.infinity_mass == 0.0
    ours = pld.self_compose(100).epsilon(1e-5)
    one_way = privacy_loss_distribution.from_laplace_mechanism(
        parameter=1.0, sensitivity=0.5, sampling_prob=0.05, value_discretization_interval=1e-4).self_compose(100).get_epsilon_for_delta(1e-5)
    assert one_way <= ours <= 1.15 * one_way
    single = LaplaceAccountant().epsilon(LaplaceStep(2.0 / 4.0, 1.0), rounds=1, local_steps=1, delta=1e-5)
    assert single == pytest.approx(0.5, abs=1e-3)  # pure epsilon of Lap(b=4) with sensitivity 2C/B = 2


def test_laplace_noise_has_the_right_scale():
    noise = laplace_noise((200000,), 0.7, noise_generator(0), torch.float64)
    assert torch.isfinite(noise).all() and float(noise.abs().mean()) == pytest.approx(0.7, rel=0.02)


def _step(policy, noise=1.0, state=None):
    dataset = SPEC.build_dataset()
    model = SPEC.build_model(dataset.info)
    params = model.init_params(None)
    x, y = dataset.client_data(0).train
    state = {} if state is None else state
    release = ddpsa_step(model.per_sample_loss, params, (x[:50], y[:50]), policy.bind(noise), state, noise,
                         noise_generator(0))
    return release, state


def test_policies_set_layerwise_thresholds():
    assert list(layers_of(["layer0.weight", "layer0.bias", "layer1.weight"])) == ["layer0", "layer1"]
    static, _ = _step(StaticClip(0.3))
    assert static.clips == {"weight": 0.3, "bias": 0.3}
    assert static.noise_scales["weight"] == pytest.approx(2 * 0.3 / 50)
    median, _ = _step(MedianClip())
    assert median.clips["weight"] != median.clips["bias"] and not MedianClip().covered
    quantile, state = _step(PrivateQuantileClip(initial_clip=1e-6, learning_rate=0.5))
    assert all(c > 1e-6 for c in state["clips"].values())  # every norm was above: thresholds grow
    nonprivate, _ = _step(StaticClip(1e9), noise=None)
    assert nonprivate.noise_scales == {"weight": 0.0, "bias": 0.0}


def _run(policy, epsilon, rounds=40, group=None, engine=None):
    dataset = SPEC.build_dataset()
    model = SPEC.build_model(dataset.info)
    return run_ddpsa(policy, engine or LocalEngine(dataset, model), group or LocalAggregators(3), model, dataset,
                     rounds=rounds, clients_per_round=4, batch_size=50, lr=1.0, epsilon=epsilon, noise_seed=0,
                     patience=rounds)


def test_nonprivate_ddpsa_fits_the_known_optimum():
    result = _run(StaticClip(100.0), None, rounds=80)
    assert result["summary"]["final_metrics"]["r2"] > 0.9
    assert result["summary"]["final_metrics"]["param_error"] < 0.2


def test_private_runs_are_charged_and_marked():
    median = _run(MedianClip(), 8.0)["summary"]
    assert median["epsilon_spent"] <= 8.0 + 1e-6 and median["guarantee"].startswith("NOT covered")
    quantile = _run(PrivateQuantileClip(), 8.0)["summary"]
    assert quantile["guarantee"] == "covered" and quantile["epsilon_spent"] <= 8.0 + 1e-6
    assert quantile["noise_multiplier"] > median["noise_multiplier"]  # the counts take a share of the budget


def test_a_failing_client_is_dropped_from_the_secure_sum():
    dataset = SPEC.build_dataset()
    model = SPEC.build_model(dataset.info)

    class FlakyEngine(LocalEngine):
        def run(self, cohort, task, theta, round_index):
            from rfedray.federated.client import ClientFailure

            results = super().run([c for c in cohort if c != 1], task, theta, round_index)
            return {**results, 1: ClientFailure("lost")}

    result = _run(StaticClip(1.0), 8.0, rounds=3, engine=FlakyEngine(dataset, model))
    assert all(r["participants"] == 3 and r["failed"] == 1 for r in result["history"])


def test_ddpsa_config_is_validated():
    from rfedray.config import ConfigError
    from rfedray.mestimation.config import DDPSAConfig, load

    cfg = load(DDPSAConfig, "configs/ddpsa_synthetic.yaml", [])
    assert cfg.ddpsa.clipping == "private_quantile"
    with pytest.raises(ConfigError, match="ddpsa.clipping"):
        load(DDPSAConfig, None, ["ddpsa.clipping=adaptive"])
    with pytest.raises(ConfigError, match="ddpsa.aggregators"):
        load(DDPSAConfig, None, ["ddpsa.aggregators=1"])


@pytest.mark.slow
def test_ray_engine_with_aggregator_actors():
    from actors.aggregators import RayAggregators
    from actors.engine import ray_task_engine

    engine = ray_task_engine(SPEC, SPEC.n_clients, num_hosts=2)
    group = RayAggregators(3)
    try:
        ray_run = _run(StaticClip(1.0), 8.0, rounds=3, group=group, engine=engine)
    finally:
        group.close()
        engine.close()
    local = _run(StaticClip(1.0), 8.0, rounds=3)
    for k in local["theta"]:
        assert torch.allclose(ray_run["theta"][k], local["theta"][k], atol=1e-6)


# ----- issue 16, item 6: the covered variant by default; the uncovered one says so everywhere ---------

DDPSA_RUN = ["run.rounds=3", "data.options.records_per_client=100", "federation.batch_size=20", "run.engine=local"]


def test_the_covered_variant_is_the_default_in_code_and_configs():
    from rfedray.mestimation.config import DDPSAConfig, load

    assert load(DDPSAConfig, None, []).ddpsa.clipping == "private_quantile"
    for config in ("configs/ddpsa_synthetic.yaml", "configs/ddpsa_diabetes.yaml"):
        assert load(DDPSAConfig, config, []).ddpsa.clipping == "private_quantile", config


@pytest.mark.parametrize("clipping, covered", [("median", False), ("private_quantile", True)])
def test_every_line_and_the_summary_say_whether_the_run_is_covered(clipping, covered, tmp_path, capsys):
    import json

    from rfedray import cli

    assert cli.main(["ddpsa", "run", "configs/ddpsa_synthetic.yaml", *DDPSA_RUN, f"ddpsa.clipping={clipping}",
                     f"run.output_dir={tmp_path}"]) == 0
    captured = capsys.readouterr()
    run_dir = tmp_path / captured.out.strip().rsplit("/", 1)[-1]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(lines) == 3 and all(line["covered"] is covered for line in lines)
    assert summary["covered"] is covered
    warned = "NOT covered by the record-level guarantee" in captured.err
    assert warned is not covered
