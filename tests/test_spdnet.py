"""SPDNet: parameter counts of Table 13, layers, manifold steps and per-sample gradients."""

import numpy as np
import pytest
import scipy.linalg
import torch
from torch.func import grad, vmap

from rfedray import registry
from rfedray.options import OptionsError
from rfedray.geometry import Euclidean, Stiefel
from rfedray.models import spdnet
from rfedray.models.spdnet import SPDNet, bimap, bimap_dims, vech
from rfedray.task import EvalData



def random_spd(n, count, generator, dtype=torch.float64, floor=1e-3):
    a = torch.randn(count, n, 3 * n, generator=generator, dtype=torch.float64)
    x = a @ a.transpose(-1, -2) / (3 * n) + floor * torch.eye(n, dtype=torch.float64)
    return x.to(dtype)


def info(channels, classes, dataset="synthetic_eeg", dtype="float64"):
    return {"channels": channels, "num_classes": classes, "dataset": dataset, "dtype": dtype, "representation": "covariance"}


def plain_eigh_features(params, x, eps):
    """Reference features through plain eigh autograd (valid where eigenvalues are distinct)."""
    z = bimap(x, params["bimap"])
    l, u = torch.linalg.eigh(z)
    s = (u * torch.log(torch.clamp_min(l, eps)).unsqueeze(-2)) @ u.transpose(-1, -2)
    return vech(s)


@pytest.mark.parametrize(
    "dataset, channels, classes, d, expected",
    [("BNCI2014_001", 22, 4, 16, 900), ("Weibo2014", 60, 7, 20, 2677), ("Cho2017", 64, 2, 16, 1298)],
)
def test_parameter_counts_match_table_13(dataset, channels, classes, d, expected):
    model = spdnet.build(spdnet.Options(), info(channels, classes, dataset))
    assert model.d == d
    assert model.num_parameters == expected
    params = model.init_params(torch.Generator().manual_seed(0))
    assert sum(p.numel() for p in params.values()) == expected
    # Table 13 counts the Stiefel weight by its ambient size C d, not by its intrinsic dimension.
    assert model.groups["bimap"].ambient_dim == channels * d
    assert model.groups["bimap"].dim == channels * d - d * (d + 1) // 2


@pytest.mark.parametrize("dataset, eps", [("BNCI2014_001", 8e-5), ("Weibo2014", 2e-5), ("Cho2017", 6e-5), ("PhysionetMI", 1e-4)])
def test_table_5_floor_is_the_default(dataset, eps):
    assert spdnet.build(spdnet.Options(), info(64, 2, dataset)).eps_reeig == eps
    assert spdnet.build(spdnet.Options(eps_reeig=1e-3), info(64, 2, dataset)).eps_reeig == 1e-3


def test_groups_and_init_on_manifolds():
    model = SPDNet(12, 3, 5, 1e-4, dtype=torch.float64)
    assert set(model.groups) == {"bimap", "head"}
    assert isinstance(model.groups["bimap"], Stiefel) and isinstance(model.groups["head"], Euclidean)
    params = model.init_params(torch.Generator().manual_seed(1))
    again = model.init_params(torch.Generator().manual_seed(1))
    for name, m in model.groups.items():
        assert params[name].shape == m.shape
        torch.testing.assert_close(params[name], again[name])
    w = params["bimap"]
    torch.testing.assert_close(w.T @ w, torch.eye(5, dtype=torch.float64))
    assert torch.all(params["head"][:, -1] == 0)


def test_vech_is_an_isometry_of_the_upper_triangle():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 5, 5, generator=g, dtype=torch.float64)
    s = a + a.transpose(-1, -2)
    v = vech(s)
    assert v.shape == (4, 15)
    torch.testing.assert_close(torch.linalg.vector_norm(v, dim=-1), torch.linalg.matrix_norm(s))
    torch.testing.assert_close(v[0, :5], s[0, 0] * torch.tensor([1.0] + [2 ** 0.5] * 4, dtype=torch.float64))


def test_bimap_keeps_spd_and_interlaces():
    g = torch.Generator().manual_seed(3)
    x = random_spd(10, 6, g)
    w = Stiefel(10, 4).random_point(generator=g)
    z = bimap(x, w)
    torch.testing.assert_close(z, z.transpose(-1, -2))
    lz, lx = torch.linalg.eigvalsh(z), torch.linalg.eigvalsh(x)
    assert torch.all(lz > 0)
    assert torch.all(lz.min(-1).values >= lx.min(-1).values - 1e-12)
    assert torch.all(lz.max(-1).values <= lx.max(-1).values + 1e-12)


def test_logeig_features_match_scipy_logm():
    g = torch.Generator().manual_seed(4)
    model = SPDNet(8, 2, 4, 1e-8, dtype=torch.float64)
    params = model.init_params(g)
    x = random_spd(8, 5, g)
    feats = model.tangent_features(params, x)
    w = params["bimap"].numpy()
    for xi, fi in zip(x.numpy(), feats):
        ref = np.real(scipy.linalg.logm(w.T @ xi @ w))
        torch.testing.assert_close(fi, vech(torch.as_tensor(ref)))


def test_stiefel_weight_stays_on_manifold_after_projected_steps():
    g = torch.Generator().manual_seed(5)
    model = SPDNet(10, 3, 4, 1e-4, dtype=torch.float32)
    params = model.init_params(g)
    x = random_spd(10, 32, g, torch.float32)
    y = torch.randint(0, 3, (32,), generator=g)
    stiefel = model.groups["bimap"]
    loss = lambda p: vmap(model.per_sample_loss, in_dims=(None, 0, 0))(p, x, y).mean()
    start = loss(params)
    for _ in range(20):
        gr = grad(loss)(params)
        params = {
            "bimap": stiefel.project(params["bimap"] - 0.5 * stiefel.proj_tangent(params["bimap"], gr["bimap"])),
            "head": params["head"] - 0.5 * gr["head"],
        }
        w = params["bimap"]
        assert torch.linalg.matrix_norm(w.T @ w - torch.eye(4)) < 1e-5
    assert loss(params) < start


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("depth", [1, 2])
def test_per_sample_gradients_equal_a_loop(dtype, depth):
    g = torch.Generator().manual_seed(6)
    model = SPDNet(12, 3, 6, 1e-3, depth=depth, dtype=dtype)
    params = model.init_params(g)
    x = random_spd(12, 16, g, dtype)
    y = torch.randint(0, 3, (16,), generator=g)
    batched = vmap(grad(model.per_sample_loss), in_dims=(None, 0, 0))(params, x, y)
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-12, rtol=1e-9)}[dtype]
    for i in range(16):
        single = grad(model.per_sample_loss)(params, x[i], y[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], single[name], **tol)


def test_per_sample_gradients_match_plain_eigh_autograd_without_ties():
    g = torch.Generator().manual_seed(7)
    model = SPDNet(9, 2, 5, 1e-9, dtype=torch.float64)
    params = model.init_params(g)
    x = random_spd(9, 8, g)
    y = torch.randint(0, 2, (8,), generator=g)

    def reference_loss(p, xi, yi):
        head = p["head"]
        logits = plain_eigh_features(p, xi, model.eps_reeig) @ head[:, :-1].T + head[:, -1]
        return torch.nn.functional.cross_entropy(logits, yi)

    ours = vmap(grad(model.per_sample_loss), in_dims=(None, 0, 0))(params, x, y)
    ref = vmap(grad(reference_loss), in_dims=(None, 0, 0))(params, x, y)
    for name in params:
        torch.testing.assert_close(ours[name], ref[name])


def test_finite_and_correct_gradients_when_reeig_clamps():
    """Low-rank inputs: several eigenvalues clamp to eps_R (ties); gradients stay finite and exact."""
    g = torch.Generator().manual_seed(8)
    model = SPDNet(10, 2, 6, 1e-2, dtype=torch.float64)
    params = model.init_params(g)
    a = torch.randn(12, 10, 3, generator=g, dtype=torch.float64)
    x = a @ a.transpose(-1, -2) + 1e-6 * torch.eye(10, dtype=torch.float64)  # rank 3 + tiny ridge
    y = torch.randint(0, 2, (12,), generator=g)
    z_eigs = torch.linalg.eigvalsh(bimap(x, params["bimap"]))
    assert ((z_eigs < model.eps_reeig).sum(-1) >= 3).all()
    per_sample = vmap(grad(model.per_sample_loss), in_dims=(None, 0, 0))(params, x, y)
    assert all(torch.isfinite(v).all() for v in per_sample.values())
    # Central differences along a random ambient direction of W, for one record.
    direction = torch.randn(10, 6, generator=g, dtype=torch.float64)
    h = 1e-6
    shifted = [dict(params, bimap=params["bimap"] + s * h * direction) for s in (1, -1)]
    fd = (model.per_sample_loss(shifted[0], x[0], y[0]) - model.per_sample_loss(shifted[1], x[0], y[0])) / (2 * h)
    torch.testing.assert_close((per_sample["bimap"][0] * direction).sum(), fd, atol=1e-6, rtol=1e-5)


def test_evaluate_batched_matches_per_record():
    g = torch.Generator().manual_seed(9)
    model = SPDNet(8, 3, 4, 1e-4, dtype=torch.float64)
    params = model.init_params(g)
    x = random_spd(8, 40, g)
    y = torch.randint(0, 3, (40,), generator=g)
    metrics = model.evaluate(params, EvalData((x, y)), chunk=7)
    losses = torch.stack([model.per_sample_loss(params, xi, yi) for xi, yi in zip(x, y)])
    preds = torch.stack([model.logits(params, xi).argmax() for xi in x])
    assert metrics["loss"] == pytest.approx(float(losses.mean()), rel=1e-10)
    assert metrics["accuracy"] == pytest.approx(float((preds == y).double().mean()))


def test_deeper_nets_chain_stiefel_groups():
    model = SPDNet(22, 4, 10, 1e-4, depth=3)
    assert bimap_dims(22, 10, 3) == [22, 18, 14, 10]
    assert list(model.groups) == ["bimap", "bimap2", "bimap3", "head"]
    assert [model.groups[n].shape for n in ("bimap", "bimap2", "bimap3")] == [(22, 18), (18, 14), (14, 10)]
    assert model.groups["head"].shape == (4, 56)


def test_options_and_build_errors():
    with pytest.raises(OptionsError, match="model.options.d"):
        spdnet.Options(d=0).validate("model.options")
    with pytest.raises(OptionsError, match="model.options.eps_reeig"):
        spdnet.Options(eps_reeig=0.0).validate("model.options")
    with pytest.raises(OptionsError, match="model.options.depth"):
        spdnet.Options(depth=0).validate("model.options")
    with pytest.raises(OptionsError, match="model.options.d"):
        spdnet.build(spdnet.Options(d=30), info(22, 4))
    with pytest.raises(OptionsError, match="representation"):
        spdnet.build(spdnet.Options(), {**info(22, 4), "representation": "raw"})
    with pytest.raises(ValueError, match="eps_reeig"):
        SPDNet(8, 2, 4, -1.0)
    resolved = registry.resolve_options(registry.model_module("spdnet"), {"d": 8, "eps_reeig": 1e-4}, "model.options")
    assert resolved == spdnet.Options(d=8, eps_reeig=1e-4, depth=1)


LAPLACIANS = [{"C3": 1.0, "FC3": -0.25, "CP3": -0.25, "C1": -0.25, "C5": -0.25},
              {"C4": 1.0, "FC4": -0.25, "CP4": -0.25, "C2": -0.25, "C6": -0.25}]
NAMES = ["FC5", "FC3", "FC1", "FCz", "FC2", "FC4", "FC6", "C5", "C3", "C1", "Cz", "C2", "C4", "C6",
         "CP5", "CP3", "CP1", "CPz", "CP2", "CP4", "CP6"]


def test_init_filters_start_the_bimap_at_the_named_spatial_filters():
    """Small Laplacians at C3 and C4: unit columns with weight 4/sqrt(20) at the centre, -1/sqrt(20) at
    each of the four neighbours, and the covariance of the filtered signals is ``W^T X W``."""
    options = registry.resolve_options(registry.model_module("spdnet"), {"init_filters": LAPLACIANS, "scale_free": True}, "model.options")
    model = spdnet.build(options, {**info(21, 2), "channel_names": NAMES})
    w = model.init_params(torch.Generator().manual_seed(0))["bimap"]
    assert w.shape == (21, 2) and model.d == 2 and model.num_parameters == 21 * 2 + 2 * 4
    assert w[NAMES.index("C3"), 0] == pytest.approx(4 / 20 ** 0.5) and w[NAMES.index("CP3"), 0] == pytest.approx(-1 / 20 ** 0.5)
    assert w[NAMES.index("C4"), 0] == 0 and (w[:, 1] != 0).sum() == 5
    torch.testing.assert_close(w.T @ w, torch.eye(2, dtype=torch.float64))
    selection = spdnet.build(spdnet.Options(init_filters=[{"C4": 2.0}, {"C3": 1.0}]), {**info(21, 2), "channel_names": NAMES})
    x = random_spd(21, 3, torch.Generator().manual_seed(1))
    z = bimap(x, selection.init_params(torch.Generator().manual_seed(0))["bimap"])
    torch.testing.assert_close(z, x[:, [12, 8]][:, :, [12, 8]])
    bad = [([{"C3": 1.0}, {"C3": 1.0, "C4": 1.0}], "orthogonal"), ([{"Xx9": 1.0}], "not among"), ([{"C3": 0.0}], "not all zero"),
           ([], "non-empty")]
    for filters, message in bad:
        with pytest.raises(OptionsError, match=f"model.options.init_filters.*{message}"):
            spdnet.Options(init_filters=filters).validate("model.options")
            spdnet.build(spdnet.Options(init_filters=filters), {**info(21, 2), "channel_names": NAMES})
    with pytest.raises(OptionsError, match="set data.options.channels"):
        spdnet.build(spdnet.Options(init_filters=LAPLACIANS), info(21, 2))
    with pytest.raises(OptionsError, match="model.options.d"):
        spdnet.Options(init_filters=LAPLACIANS, d=3).validate("model.options")


def test_scale_free_features_ignore_each_records_scale():
    """With ``scale_free`` a record scaled by c > 0 has the same features (per record, no other
    record involved); without it the diagonal features move by log c."""
    x = random_spd(6, 4, torch.Generator().manual_seed(2))
    scales = torch.tensor([0.01, 1.0, 3.0, 100.0], dtype=torch.float64)[:, None, None]
    for scale_free in (True, False):
        model = SPDNet(6, 2, 3, 1e-6, dtype=torch.float64, scale_free=scale_free)
        params = model.init_params(torch.Generator().manual_seed(0))
        moved = model.tangent_features(params, scales * x) - model.tangent_features(params, x)
        diagonal = torch.triu_indices(3, 3)[0] == torch.triu_indices(3, 3)[1]
        expected = torch.zeros_like(moved) if scale_free else torch.log(scales[:, :, 0]) * diagonal.double()
        torch.testing.assert_close(moved, expected, atol=1e-8, rtol=0)
    one = model.tangent_features(params, x[0])
    torch.testing.assert_close(one, model.tangent_features(params, x)[0])
