"""Group-wise clipping with shares of C (rfedray.privacy.mechanism.ClipShares, ``privacy.clip_shares``).

Each group's tangent gradient of a record is clipped to ``s_g C`` with ``sum_g s_g^2 = 1``, so a
clipped record's norm is at most ``C`` and the step's sensitivity, hence its accounting, is that of
joint clipping at ``C`` (Opacus's per-layer clipping).
"""

import json
import math

import pytest
import torch

from rfedray.cli import main
from rfedray.geometry import Euclidean, Grassmann, ProductManifold, Sphere, Stiefel
from rfedray.models.fedpca import GROUP, ProjectorGradients
from rfedray.privacy.checks import PrivacyParameterError
from rfedray.privacy.mechanism import (
    ClipShares, noise_generator, per_sample_gradients, private_gradient, standard_noise,
)

B, D = 16, 6
GROUPS = ("w", "g", "u", "h")


def product():
    return ProductManifold({"w": Stiefel(D, 3), "g": Grassmann(D, 2), "u": Sphere(D), "h": Euclidean(4)})


def loss(params, z, y, a):
    """A nonlinear loss of one record ``(z, y, a)`` touching every group, ``a`` (4,) the record's weight in each."""
    w, g, u, h = params["w"], params["g"], params["u"], params["h"]
    pred = a[0] * torch.tanh(w.T @ z).sum() + a[1] * (z @ g @ z) + a[2] * (u @ z) ** 2 + a[3] * (h * z[:4]).sum()
    return (pred - y) ** 2


def setup(seed, batch=B):
    """A random point and records whose gradients range over orders of magnitude, per group."""
    gen = torch.Generator().manual_seed(seed)
    prod = product()
    params = prod.random_point(generator=gen)
    z = torch.randn(batch, D, dtype=torch.float64, generator=gen)
    y = torch.randn(batch, dtype=torch.float64, generator=gen)
    a = torch.exp(3.0 * torch.randn(batch, 4, dtype=torch.float64, generator=gen))
    return prod, params, (z, y, a)


def random_shares(gen) -> ClipShares:
    raw = torch.rand(len(GROUPS), dtype=torch.float64, generator=gen) + 0.01
    return ClipShares.of(dict(zip(GROUPS, (raw / raw.norm()).tolist())))


def zero_noise(prod, params):
    return {g: torch.zeros_like(params[g], dtype=torch.float64) for g in prod.groups}


def tangent_gradients(prod, params, records):
    """Reference: each record's projected gradient ``{g: (B, *shape_g)}`` and its norms per group ``{g: (B,)}``."""
    tangent = prod.proj_tangent(params, per_sample_gradients(loss, params, records))
    return tangent, {g: t.flatten(1).norm(dim=1) for g, t in tangent.items()}


def test_every_clipped_record_has_norm_at_most_c_and_each_group_at_most_its_share():
    """Random shares, clips and records whose gradients span orders of magnitude per group. The released
    value of a one-record batch without noise is that record's clipped gradient."""
    gen = torch.Generator().manual_seed(1000)
    clipped = kept = 0
    for seed in range(25):
        prod, params, records = setup(seed, batch=6)
        shares = random_shares(gen)
        clip = float(torch.rand((), dtype=torch.float64, generator=gen)) * 5 + 0.01
        tangent, norms = tangent_gradients(prod, params, records)
        for l in range(6):
            one = tuple(r[l:l + 1] for r in records)
            out = private_gradient(loss, params, prod, one, clip=clip, sigma=1.0,
                                   noise=zero_noise(prod, params), shares=shares)
            assert float(prod.norm(out)) <= clip * (1 + 1e-12)
            for g, bound in shares.bounds(clip).items():
                raw = float(norms[g][l])
                assert float(out[g].norm()) == pytest.approx(min(raw, bound), rel=1e-9, abs=1e-12)
                # A group is scaled on its own, never by another group's norm.
                torch.testing.assert_close(out[g], tangent[g][l] * min(1.0, bound / raw), rtol=1e-9, atol=1e-12)
                clipped += raw > bound
                kept += raw < bound
    assert clipped > 50 and kept > 50  # both branches, many times


def test_group_clipped_mean_matches_a_reference():
    prod, params, records = setup(3)
    shares = ClipShares.of({"w": 0.5, "g": 0.5, "u": 0.5, "h": 0.5})
    clip = 2.0
    tangent, norms = tangent_gradients(prod, params, records)
    reference = {g: (tangent[g] * torch.clamp(shares.bounds(clip)[g] / norms[g], max=1.0).view(-1, *[1] * (tangent[g].dim() - 1))).mean(0)
                 for g in prod.groups}
    out = private_gradient(loss, params, prod, records, clip=clip, sigma=1e-14,
                           noise=standard_noise(prod, params, noise_generator(1)), shares=shares)
    for g in prod.groups:
        torch.testing.assert_close(out[g], reference[g], rtol=0, atol=1e-12)
    # It is not joint clipping: the joint rule gives another value here.
    joint = private_gradient(loss, params, prod, records, clip=clip, sigma=1e-14,
                             noise=standard_noise(prod, params, noise_generator(1)))
    assert max(float((joint[g] - out[g]).abs().max()) for g in prod.groups) > 1e-3


def test_one_replaced_record_moves_the_release_by_at_most_2c_over_b():
    """The sensitivity the accountant assumes (``mu0 = 2C / (B sigma)``) holds for every choice of shares."""
    gen = torch.Generator().manual_seed(7)
    for seed in range(10):
        prod, params, (z, y, a) = setup(seed)
        shares, clip = random_shares(gen), 0.3
        z2, y2, a2 = z.clone(), y.clone(), a.clone()
        z2[5], y2[5], a2[5] = 100.0 * torch.ones(D, dtype=torch.float64), -1e3, 1e3
        kw = dict(clip=clip, sigma=0.7, shares=shares)
        out = private_gradient(loss, params, prod, (z, y, a),
                               noise=standard_noise(prod, params, noise_generator(3)), **kw)
        neighbour = private_gradient(loss, params, prod, (z2, y2, a2),
                                     noise=standard_noise(prod, params, noise_generator(3)), **kw)
        gap = float(prod.norm({g: out[g] - neighbour[g] for g in out}))
        assert 0.0 < gap <= 2 * clip / B * (1 + 1e-12)


def test_a_record_large_in_every_group_reaches_norm_c_exactly():
    """The bound is tight: shares spend all of C, not less (so the accounting is not loose either)."""
    prod, params, (z, y, a) = setup(4, batch=1)
    shares = ClipShares.of({"w": 0.8, "g": 0.36, "u": 0.36, "h": math.sqrt(1 - 0.64 - 2 * 0.36 ** 2)})
    out = private_gradient(loss, params, prod, (z, y + 1e3, a * 0 + 1e3), clip=0.5, sigma=1.0,
                           noise=zero_noise(prod, params), shares=shares)
    assert float(prod.norm(out)) == pytest.approx(0.5, rel=1e-12)


def test_one_group_with_share_one_is_joint_clipping_bit_for_bit():
    """Generic path (vmap(grad)) and a model's closed-form rule (federated PCA)."""
    prod, params, (z, y, a) = setup(5)
    single = ProductManifold({"w": prod.groups["w"]})

    def loss_w(p, z, y):
        return (torch.tanh(p["w"].T @ z).sum() * 40.0 - y) ** 2

    theta = {"w": params["w"]}
    noise = standard_noise(single, theta, noise_generator(2))
    joint = private_gradient(loss_w, theta, single, (z, y), clip=1.0, sigma=0.3, noise=noise)
    grouped = private_gradient(loss_w, theta, single, (z, y), clip=1.0, sigma=0.3, noise=noise,
                               shares=ClipShares.of({"w": 1.0}))
    assert torch.equal(joint["w"], grouped["w"])

    gen = torch.Generator().manual_seed(0)
    grass = ProductManifold({GROUP: Grassmann(8, 2)})
    point = grass.random_point(generator=gen)
    records = (3.0 * torch.randn(B, 8, dtype=torch.float64, generator=gen),)
    noise = standard_noise(grass, point, noise_generator(4))
    kw = dict(clip=1.0, sigma=0.2, noise=noise, rule=ProjectorGradients())
    joint = private_gradient(None, point, grass, records, **kw)
    grouped = private_gradient(None, point, grass, records, shares=ClipShares.of({GROUP: 1.0}), **kw)
    assert torch.equal(joint[GROUP], grouped[GROUP])


@pytest.mark.parametrize("shares, message", [
    ({"w": 0.6, "g": 0.6}, "squares of the shares must sum to 1"),
    ({"w": 1.0, "g": 1e-4}, "squares of the shares must sum to 1"),
    ({"w": 1.0, "g": 0.0}, "must be in (0, 1]"),
    ({"w": -1.0}, "must be in (0, 1]"),
    ({}, "name each parameter group once"),
])
def test_bad_shares_are_refused_naming_the_field(shares, message):
    with pytest.raises(PrivacyParameterError, match="clip_shares") as info:
        ClipShares.of(shares)
    assert message in str(info.value)


def test_shares_must_name_exactly_the_model_groups():
    prod, params, records = setup(0)
    kw = dict(clip=1.0, sigma=0.1, noise=standard_noise(prod, params, noise_generator(0)))
    with pytest.raises(PrivacyParameterError, match="unknown group 'head'"):
        private_gradient(loss, params, prod, records, shares=ClipShares.of({"head": 1.0}), **kw)
    with pytest.raises(PrivacyParameterError, match="no share for group 'g'; .* w, g, u, h"):
        private_gradient(loss, params, prod, records, shares=ClipShares.of({"w": 1.0}), **kw)


SPDNET_RUN = [
    "model.name=spdnet", "data.source=synthetic_eeg", "data.options.channels=8", "model.options.d=3",
    "data.options.trials_per_client=32", "federation.n_clients=3", "federation.clients_per_round=3",
    "federation.local_steps=2", "federation.batch_size=8", "run.rounds=3", "privacy.epsilon=5",
    "privacy.clip=1.0", "privacy.noise_seed=3", "run.engine=local", "monitoring.progress=false",
]


def run_summary(tmp_path, name, *overrides):
    assert main(["run", *SPDNET_RUN, f"run.output_dir={tmp_path}", f"run.name={name}", "--quiet", *overrides]) == 0
    (run_dir,) = tmp_path.glob(f"{name}-*")
    model = torch.load(run_dir / "model_final.pt", weights_only=True)
    return json.loads((run_dir / "summary.json").read_text()), (run_dir / "budget.json").read_text(), model


def test_a_run_with_clip_shares_is_accounted_exactly_as_joint_clipping(tmp_path):
    """Same calibrated sigma, same epsilon and the same budget file; only the model moves differently."""
    joint, joint_budget, joint_model = run_summary(tmp_path, "joint")
    grouped, grouped_budget, grouped_model = run_summary(
        tmp_path, "grouped", "privacy.clip_shares={head: 0.95, bimap: %.15f}" % math.sqrt(1 - 0.95 ** 2))
    for key in ("sigma", "clip", "epsilon_spent", "delta", "accountant"):
        assert grouped[key] == joint[key], key
    budgets = [json.loads(b) for b in (joint_budget, grouped_budget)]
    for key in ("fingerprint", "ledger"):  # the privacy parameters and every client's charges (the rest is a hash chain)
        assert budgets[0][key] == budgets[1][key], key
    assert not torch.equal(joint_model["head"], grouped_model["head"])


@pytest.mark.parametrize("shares, message", [
    ("{head: 0.9, bimap: 0.3}", "error: privacy.clip_shares="),
    ("{head: 0.6, bimap: 0.8, bias: 0.0}", "error: privacy.clip_shares.bias=0.0: must be in (0, 1]"),
    ("{head: 0.6, filters: 0.8}", "unknown group 'filters'; give a share to each of the model's groups: bimap, head"),
])
def test_bad_clip_shares_in_a_run_are_one_error_line(tmp_path, capsys, shares, message):
    code = main(["run", *SPDNET_RUN, f"run.output_dir={tmp_path}", "--quiet", f"privacy.clip_shares={shares}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not any(tmp_path.iterdir())
