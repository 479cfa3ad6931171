"""The one local-training kernel (rfedray.federated.client.train_together, of which Client.local_train
is the one-client case) against Algorithm 1's client loop written out step by step in this file, and
the tangent charts the private step measures and sums per-sample gradients in.

Bitwise equality with the step-by-step loop holds where every matrix product goes through BLAS on
both paths (the paper's shapes: Gr(40, 4), SPDNet 22 -> 16). For tiny matrices (fewer than 400
multiply-adds per product) torch's CPU ``bmm`` (the kernel's stacked path) uses its own loop while
``mm`` (the loop's) calls BLAS: the same sums in another order, equal to a few float32 ulps. The
kernel is bitwise independent of which clients share the call at every size.
"""

import json
import logging

import pytest
import torch

from rfedray import aggregation
from rfedray.config import load_config
from rfedray.federated import executor as executor_module
from rfedray.federated.client import LocalResult, batch_key, round_generator, train_together
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.loop import Federation, run_federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import build_scheme, initial_params, local_plan
from rfedray.geometry import Euclidean, Grassmann, ProductManifold, Sphere, Stiefel
from rfedray.optim import build_optimizer
from rfedray.privacy.mechanism import (
    noise_generator, nonprivate_gradient, per_sample_gradients, private_gradient,
    sample_batch, standard_noise,
)

COMMON = [
    "federation.n_clients=6", "federation.clients_per_round=4", "federation.local_steps=2",
    "privacy.noise_seed=7", "privacy.sigma=0.5", "privacy.epsilon=null",
    "monitoring.progress=false",
]
PCA = ["data.options.d=40", "data.options.p=4", "data.options.records_per_client=120",
       "data.options.size_spread=0.5", "federation.batch_size=30"]
TINY_PCA = ["data.options.d=12", "data.options.p=2", "data.options.records_per_client=120",
            "data.options.size_spread=0.5", "federation.batch_size=30"]
SPDNET = ["model.name=spdnet", "data.source=synthetic_eeg", "data.options.channels=22", "model.options.d=16",
          "data.options.trials_per_client=32", "federation.batch_size=12"]
ADAM = ["optim.default.name=adam", "optim.default.lr=0.01"]
COHORTS = [[0, 1, 2, 3], [1, 2, 4, 5], [0, 2, 3, 5], [0, 1, 2, 3]]
"""Overlapping cohorts: from round 1 on, clients start with different optimiser states (none, or
Adam step counters of different values), so a round mixes groups of several sizes."""

TINY_ULPS = 1e-6
"""Tolerance of the tiny-matrix comparisons (float32 parameters of norm ~1; see the module docstring)."""


def federation(tmp_path, *overrides):
    cfg = load_config(None, [*COMMON, f"run.output_dir={tmp_path}", *overrides])
    fed = Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "x"))
    return cfg, fed, local_plan(cfg, fed.privacy), initial_params(cfg, fed.model)


def tensors(result):
    """Every tensor of a LocalResult: its submission and its optimiser state."""
    out = dict(result.submission)
    for group, saved in result.optimizer_state.items():
        out.update({f"{group}.{key}": value for key, value in saved["state"].items()})
    return out


def algorithm_1(fed, plan, client_id, theta, round_index, optimizer_state):
    """One client's round of Algorithm 1, step by step, from the library's public pieces (the oracle)::

        for j < tau: draw B records and xi; g = clipped mean of P grad f + P xi; theta <- Opt(g)
        release Agg.Sub(theta_t, theta_local) and the optimisers' state
    """
    cfg, groups = fed.cfg, fed.model.groups
    product = ProductManifold(groups)
    records = fed.dataset.client_data(client_id).train
    optimizers = {g: build_optimizer(cfg.optim.get(g, cfg.optim["default"]), m, plan.total_rounds * plan.local_steps)
                  for g, m in groups.items()}
    for g, opt in optimizers.items():
        opt.load_state_dict((optimizer_state or {}).get(g, {}))
    generator = round_generator(plan.noise_seed, client_id, round_index)
    params = {g: v.clone() for g, v in theta.items()}
    for j in range(plan.local_steps):
        index = sample_batch(int(records[0].shape[0]), plan.batch_size, generator)
        noise = standard_noise(product, params, generator) if plan.private else None
        batch = tuple(r.index_select(0, index) for r in records)
        if plan.private:
            grad = private_gradient(fed.model.per_sample_loss, params, product, batch,
                                    clip=plan.mechanism.clip, sigma=plan.mechanism.sigma, noise=noise,
                                    rule=fed.model.gradient_rule)
        else:
            grad = nonprivate_gradient(fed.model.per_sample_loss, params, product, batch)
        params = {g: optimizers[g].step(params[g], grad[g], round_index * plan.local_steps + j) for g in params}
    submission = aggregation.submit(build_scheme(cfg), product, theta, params)
    return LocalResult(submission, {g: opt.state_dict() for g, opt in optimizers.items()}, 0.0)


def compare(tmp_path, *overrides, cohorts=COHORTS):
    """Rounds of the executor (the kernel) against Algorithm 1's loop; max |difference| and bitwise flag."""
    cfg, fed, plan, theta = federation(tmp_path, *overrides)
    together = LocalExecutor(cfg, fed.dataset, fed.model, plan)
    states_a, states_b, worst, bitwise = {}, {}, 0.0, True
    for t, chosen in enumerate(cohorts):
        a = together.train(chosen, theta, t, states_a)
        b = {cid: algorithm_1(fed, plan, cid, theta, t, states_b.get(cid)) for cid in chosen}
        assert list(a) == list(b) == chosen
        for cid in chosen:
            ta, tb = tensors(a[cid]), tensors(b[cid])
            assert ta.keys() == tb.keys()
            for key in ta:
                assert ta[key].shape == tb[key].shape and ta[key].dtype == tb[key].dtype
                bitwise &= torch.equal(ta[key], tb[key])
                worst = max(worst, float((ta[key].double() - tb[key].double()).abs().max()))
            states_a[cid], states_b[cid] = a[cid].optimizer_state, b[cid].optimizer_state
    return bitwise, worst


@pytest.mark.parametrize("optim", [[], ADAM], ids=["rsgd", "adam"])
@pytest.mark.parametrize("task", [PCA, SPDNET], ids=["fedpca-grassmann", "spdnet-stiefel"])
def test_the_kernel_is_bitwise_algorithm_1s_loop(tmp_path, task, optim):
    bitwise, worst = compare(tmp_path, *task, *optim)
    assert bitwise, f"max |difference| {worst:.3g}"


@pytest.mark.parametrize("optim", [[], ADAM, ["optim.default.name=sgd", "optim.default.momentum=0.9"]],
                         ids=["rsgd", "adam", "sgd-momentum"])
def test_the_kernel_on_tiny_matrices_equals_algorithm_1s_loop_to_float_rounding(tmp_path, optim):
    _, worst = compare(tmp_path, *TINY_PCA, *optim)
    assert worst <= TINY_ULPS


def test_the_nonprivate_kernel_is_the_loop(tmp_path):
    bitwise, worst = compare(tmp_path, *PCA, "privacy.enabled=false", cohorts=COHORTS[:2])
    assert bitwise, f"max |difference| {worst:.3g}"


@pytest.mark.parametrize("task", [TINY_PCA + ADAM, ["model.name=spdnet", "data.source=synthetic_eeg",
                                                     "model.options.d=4", "federation.batch_size=12"]])
def test_batched_results_do_not_depend_on_the_other_clients_of_the_call(tmp_path, task):
    cfg, fed, plan, theta = federation(tmp_path, *task)
    ex = LocalExecutor(cfg, fed.dataset, fed.model, plan)
    clients = [ex.client(c) for c in range(4)]
    for t in range(2):
        all_four = train_together(clients, theta, t, [None] * 4)
        pair = train_together(clients[1:3], theta, t, [None] * 2)
        alone = [train_together([c], theta, t, [None])[0] for c in clients]
        local = [c.local_train(theta, t) for c in clients]  # the one-client case, without vmap
        for x, y, z in zip(all_four, alone, local):
            assert all(torch.equal(x.submission[g], y.submission[g]) for g in theta)
            assert all(float((x.submission[g] - z.submission[g]).abs().max()) <= TINY_ULPS for g in theta)
        for x, y in zip(all_four[1:3], pair):
            assert all(torch.equal(x.submission[g], y.submission[g]) for g in theta)


def test_batch_key_groups_clients_by_optimiser_state_structure(tmp_path):
    cfg, fed, plan, theta = federation(tmp_path, *TINY_PCA, *ADAM)
    ex = LocalExecutor(cfg, fed.dataset, fed.model, plan)
    trained = ex.train([0, 1], theta, 0, {})
    once = {cid: r.optimizer_state for cid, r in trained.items()}
    twice = ex.train([0], theta, 1, once)[0].optimizer_state
    key = batch_key
    assert key(ex.client(0), None) == key(ex.client(1), None) == key(ex.client(2), {})
    assert key(ex.client(0), once[0]) == key(ex.client(1), once[1])
    assert key(ex.client(0), None) != key(ex.client(0), once[0])
    assert key(ex.client(0), once[0]) != key(ex.client(0), twice)  # Adam step counters differ
    with pytest.raises(ValueError, match="trained together"):
        train_together([ex.client(0), ex.client(1)], theta, 2, [twice, once[1]])


def test_a_group_that_cannot_be_batched_falls_back_to_the_loop(tmp_path, monkeypatch, caplog):
    cfg, fed, plan, theta = federation(tmp_path, *PCA)
    reference = LocalExecutor(cfg, fed.dataset, fed.model, plan, vectorise=False).train([0, 1, 2], theta, 0, {})

    def cannot(*args, **kwargs):
        raise RuntimeError("vmap: no batching rule")

    monkeypatch.setattr(executor_module, "train_together", cannot)
    with caplog.at_level(logging.WARNING, logger="rfedray.federated.executor"):
        results = LocalExecutor(cfg, fed.dataset, fed.model, plan).train([0, 1, 2], theta, 0, {})
    assert "could not be trained together" in caplog.text
    for cid, r in reference.items():
        assert all(torch.equal(results[cid].submission[g], r.submission[g]) for g in theta)


def test_accountant_charges_and_model_are_those_of_the_loop(tmp_path):
    overrides = [*COMMON, *PCA, "run.rounds=4", "privacy.accountant=exact", "run.checkpoint_every=2",
                 f"run.output_dir={tmp_path}"]
    runs = {}
    for name, vectorise in (("together", True), ("loop", False)):
        cfg = load_config(None, overrides)
        rd = RunDirectory.create(str(tmp_path), name)

        def factory(fed, vectorise=vectorise):
            return LocalExecutor(fed.cfg, fed.dataset, fed.model, local_plan(fed.cfg, fed.privacy), vectorise)

        summary = run_federation(cfg, rd, executor_factory=factory)
        runs[name] = summary, json.loads(rd.budget.read_text())["ledger"], torch.load(rd.final_model)
    (s1, ledger1, theta1), (s2, ledger2, theta2) = runs["together"], runs["loop"]
    assert s1["epsilon_spent"] == s2["epsilon_spent"] > 0
    assert ledger1 == ledger2 and sum(ledger1["participations"]) == 4 * 4
    assert all(torch.equal(theta1[k], theta2[k]) for k in theta1)


@pytest.mark.parametrize("manifold", [Grassmann(9, 2), Grassmann(9, 7), Grassmann(8, 4), Stiefel(7, 3),
                                      Sphere(5), Euclidean(3, 2)], ids=repr)
def test_tangent_coordinates_are_an_isometric_linear_chart(manifold):
    g = torch.Generator().manual_seed(0)
    x = manifold.random_point(generator=g)
    z = torch.randn(6, *manifold.shape, generator=g, dtype=torch.float64)
    projected = manifold.proj_tangent(x, z)
    torch.testing.assert_close(manifold.tangent_norm(x, z), manifold.norm(projected), rtol=1e-12, atol=1e-12)
    chart = manifold.tangent_coordinates(x)
    coords = chart.coordinates(z)
    assert coords.shape[0] == 6 and coords.dim() == 1 + len(manifold.shape)
    torch.testing.assert_close(chart.vector(coords), projected, rtol=0, atol=1e-12)
    weights = torch.rand(6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(chart.vector(torch.tensordot(weights, coords, dims=1)),
                               torch.tensordot(weights, projected, dims=1), rtol=0, atol=1e-12)


def test_grassmann_chart_differentiates_through_the_point():
    m = Grassmann(6, 2)
    x = m.random_point(generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    z = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (grad_chart,) = torch.autograd.grad(m.tangent_norm(x, z).sum(), x)
    (grad_projection,) = torch.autograd.grad(m.norm(m.proj_tangent(x, z)).sum(), x)
    torch.testing.assert_close(grad_chart, grad_projection, rtol=1e-12, atol=1e-12)


def product():
    return ProductManifold({"g": Grassmann(10, 7), "w": Stiefel(6, 3), "h": Euclidean(4)})


def loss(params, z, y):
    pred = z @ params["g"] @ z + torch.tanh(params["w"].T @ z[:6]).sum() + (params["h"] * z[:4]).sum()
    return (pred - y) ** 2


def test_private_gradient_is_the_projected_clipped_mean_plus_projected_noise():
    """The chart-based computation against the definition, with real noise and one non-finite record."""
    gen = torch.Generator().manual_seed(3)
    prod = product()
    params = prod.random_point(generator=gen)
    z = torch.randn(16, 10, generator=gen, dtype=torch.float64)
    y = torch.randn(16, generator=gen, dtype=torch.float64)
    y[4] = float("nan")
    clip, sigma = 60.0, 0.3
    out = private_gradient(loss, params, prod, (z, y), clip=clip, sigma=sigma,
                           noise=standard_noise(prod, params, noise_generator(5)))
    tangent = prod.proj_tangent(params, per_sample_gradients(loss, params, (z, y)))
    norms = prod.norm(tangent)
    keep = torch.isfinite(norms)
    assert (norms[keep] > clip).any() and (norms[keep] < clip).any()
    scale = torch.where(keep, torch.clamp(clip / norms, max=1.0), 0.0)
    noise = standard_noise(prod, params, noise_generator(5))
    for k, m in prod.groups.items():
        clipped = torch.where(keep.view(-1, *[1] * (tangent[k].dim() - 1)), tangent[k], 0.0)
        mean = (clipped * scale.view(-1, *[1] * (clipped.dim() - 1))).sum(0) / 16
        reference = mean + sigma * m.proj_tangent(params[k], noise[k])
        torch.testing.assert_close(out[k], reference, rtol=0, atol=1e-12)


def test_a_large_group_is_trained_in_parts_with_the_same_bits(tmp_path, monkeypatch):
    cfg, fed, plan, theta = federation(tmp_path, *TINY_PCA)
    whole = LocalExecutor(cfg, fed.dataset, fed.model, plan).train([0, 1, 2, 3, 4], theta, 0, {})
    sizes = []
    kernel = executor_module.train_together
    monkeypatch.setattr(executor_module, "train_together", lambda clients, *a: sizes.append(len(clients)) or kernel(clients, *a))
    monkeypatch.setattr(executor_module, "MOST_TOGETHER", 2)
    parts = LocalExecutor(cfg, fed.dataset, fed.model, plan).train([0, 1, 2, 3, 4], theta, 0, {})
    assert sizes == [2, 2, 1]
    for cid in range(5):
        assert all(torch.equal(whole[cid].submission[g], parts[cid].submission[g]) for g in theta)


@pytest.mark.parametrize("optim", [[], ADAM], ids=["rsgd", "adam"])
def test_a_clients_result_holds_only_its_own_values(tmp_path, optim):
    """Each client's submission and optimiser state own their memory: a slice of the K clients'
    stacked tensors would carry (and, sent to the server, serialise) all K clients' values."""
    cfg, fed, plan, theta = federation(tmp_path, *PCA, *optim)
    ex = LocalExecutor(cfg, fed.dataset, fed.model, plan)
    results = train_together([ex.client(c) for c in range(4)], theta, 0, [None] * 4)
    for result in results:
        for name, value in tensors(result).items():
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), name


def test_a_result_sent_to_another_process_is_the_same_bits_as_arrays(tmp_path):
    """A LocalResult pickles its tensors as numpy arrays (rfedray.federated.wire) and comes back equal,
    dtype and shape included, in tensors that own writable memory."""
    import pickle

    from rfedray.federated.wire import Array

    cfg, fed, plan, theta = federation(tmp_path, *TINY_PCA, *ADAM)
    ex = LocalExecutor(cfg, fed.dataset, fed.model, plan)
    sent = ex.train([0, 1], theta, 0, {})[1]
    wire = pickle.dumps(sent)
    assert b"rfedray.federated.wire" in wire and Array.__name__.encode() in wire
    got = pickle.loads(wire)
    assert tensors(got).keys() == tensors(sent).keys() and got.train_seconds == sent.train_seconds
    for key, value in tensors(sent).items():
        back = tensors(got)[key]
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value), key
        back.add_(0)  # writable
