"""The private step's gradient (rfedray.privacy.mechanism): per-sample gradients, clipping, noise, sampling."""

import math

import pytest
import torch

from rfedray.geometry import Euclidean, Grassmann, ProductManifold, Sphere, Stiefel
from rfedray.privacy.mechanism import (
    noise_generator,
    nonprivate_gradient,
    per_sample_gradients,
    private_gradient,
    sample_batch,
    standard_noise,
)

B, D = 16, 6


def product():
    return ProductManifold({"w": Stiefel(D, 3), "g": Grassmann(D, 2), "u": Sphere(D), "h": Euclidean(4)})


def loss(params, z, y):
    """A nonlinear loss of one record ``(z, y)`` touching every group."""
    w, g, u, h = params["w"], params["g"], params["u"], params["h"]
    pred = torch.tanh(w.T @ z).sum() + z @ g @ z + (u @ z) ** 2 + (h * z[:4]).sum()
    return (pred - y) ** 2


def setup(seed=0, batch=B):
    gen = torch.Generator().manual_seed(seed)
    prod = product()
    params = prod.random_point(generator=gen)
    z = torch.randn(batch, D, dtype=torch.float64, generator=gen)
    y = torch.randn(batch, dtype=torch.float64, generator=gen)
    return prod, params, (z, y)


def loop_gradients(params, records):
    """Per-sample gradients by a Python loop over the records (the reference)."""
    out = {k: [] for k in params}
    for i in range(records[0].shape[0]):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        grads = torch.autograd.grad(loss(leaves, *(r[i] for r in records)), list(leaves.values()))
        for k, gr in zip(leaves, grads):
            out[k].append(gr)
    return {k: torch.stack(v) for k, v in out.items()}


def clipped_mean(prod, params, records, clip):
    """Reference: loop gradients, tangent projection, joint clipping, average."""
    tangent = prod.proj_tangent(params, loop_gradients(params, records))
    norms = prod.norm(tangent)
    scale = torch.clamp(clip / norms, max=1.0)
    return {k: (v * scale.view(-1, *([1] * (v.dim() - 1)))).mean(0) for k, v in tangent.items()}


def test_per_sample_gradients_match_a_loop():
    prod, params, records = setup()
    fast = per_sample_gradients(loss, params, records)
    slow = loop_gradients(params, records)
    for k in params:
        assert fast[k].shape == (B, *params[k].shape)
        torch.testing.assert_close(fast[k], slow[k], rtol=1e-12, atol=1e-12)


def test_private_gradient_is_the_clipped_mean_plus_projected_noise():
    prod, params, records = setup()
    clip = 20.0
    reference = clipped_mean(prod, params, records, clip)
    out = private_gradient(loss, params, prod, records, clip=clip, sigma=1e-14,
                           noise=standard_noise(prod, params, noise_generator(1)))
    for k in params:
        torch.testing.assert_close(out[k], reference[k], rtol=0, atol=1e-12)
    # Clipping was active for some records and not others: the test exercises both branches.
    norms = prod.norm(prod.proj_tangent(params, loop_gradients(params, records)))
    assert (norms > clip).any() and (norms < clip).any()


def test_noise_has_the_requested_scale_and_is_tangent():
    prod, params, records = setup()
    sigma = 3.0
    draws = [private_gradient(loss, params, prod, records, clip=0.1, sigma=sigma,
                              noise=standard_noise(prod, params, noise_generator(s)))
             for s in range(40)]
    for k, m in prod.groups.items():
        for out in draws:
            torch.testing.assert_close(m.proj_tangent(params[k], out[k]), out[k], rtol=0, atol=1e-10)
        # E||P xi||^2 = sigma^2 dim(T_x M); the clipped mean (norm <= 0.1) is negligible at sigma = 3.
        mean_sq = sum(float((out[k] ** 2).sum()) for out in draws) / len(draws)
        assert mean_sq == pytest.approx(sigma ** 2 * m.dim, rel=0.35)


def test_sensitivity_of_one_replaced_record_is_at_most_2c_over_b():
    """Same noise, one record replaced by an adversarial one: the outputs differ by <= 2C/B."""
    prod, params, (z, y) = setup()
    clip = 0.3
    z2, y2 = z.clone(), y.clone()
    z2[5], y2[5] = 100.0 * torch.ones(D, dtype=torch.float64), -1e3
    a = private_gradient(loss, params, prod, (z, y), clip=clip, sigma=0.7,
                         noise=standard_noise(prod, params, noise_generator(3)))
    b = private_gradient(loss, params, prod, (z2, y2), clip=clip, sigma=0.7,
                         noise=standard_noise(prod, params, noise_generator(3)))
    gap = float(prod.norm({k: a[k] - b[k] for k in a}))
    assert 0.0 < gap <= 2 * clip / B + 1e-12


def test_non_finite_record_contributes_zero():
    prod, params, (z, y) = setup()
    y = y.clone()
    y[2] = float("nan")
    out = private_gradient(loss, params, prod, (z, y), clip=0.5, sigma=1e-14,
                           noise=standard_noise(prod, params, noise_generator(0)))
    keep = torch.arange(B) != 2
    reference = clipped_mean(prod, params, (z[keep], y[keep]), 0.5)
    for k in params:
        assert torch.isfinite(out[k]).all()
        torch.testing.assert_close(out[k], reference[k] * (B - 1) / B, rtol=0, atol=1e-12)


def test_nonprivate_gradient_is_the_projected_mean_gradient():
    prod, params, records = setup()
    out = nonprivate_gradient(loss, params, prod, records)
    reference = prod.proj_tangent(params, {k: v.mean(0) for k, v in loop_gradients(params, records).items()})
    for k in params:
        torch.testing.assert_close(out[k], reference[k], rtol=1e-12, atol=1e-12)


def test_private_gradient_bad_arguments():
    prod, params, records = setup()
    gen = noise_generator(0)
    with pytest.raises(ValueError, match=r"clip=0.0: must be > 0"):
        private_gradient(loss, params, prod, records, clip=0.0, sigma=1.0, noise=standard_noise(prod, params, gen))
    with pytest.raises(ValueError, match=r"sigma=-1.0: must be > 0"):
        private_gradient(loss, params, prod, records, clip=1.0, sigma=-1.0, noise=standard_noise(prod, params, gen))
    with pytest.raises(ValueError, match=r"records=.*leading batch dimension"):
        private_gradient(loss, params, prod, (records[0], records[1][:3]), clip=1.0, sigma=1.0,
                         noise=standard_noise(prod, params, gen))


def test_sample_batch_draws_exactly_b_distinct_indices():
    gen = noise_generator(0)
    for m, b in ((10, 10), (10, 3), (5000, 500), (1, 1)):
        index = sample_batch(m, b, gen)
        assert index.dtype == torch.int64 and index.shape == (b,)
        assert len(set(index.tolist())) == b
        assert 0 <= int(index.min()) and int(index.max()) < m


def test_sample_batch_is_uniform_without_replacement():
    """Every record is included with probability q = B/m, and every pair with B(B-1)/(m(m-1))."""
    gen = noise_generator(0)
    m, b, runs = 8, 3, 20000
    counts = torch.zeros(m)
    pair = 0
    for _ in range(runs):
        index = sample_batch(m, b, gen)
        counts[index] += 1
        pair += int(bool((index == 0).any() and (index == 1).any()))
    q = b / m
    sd = math.sqrt(q * (1 - q) / runs)
    assert ((counts / runs - q).abs() < 5 * sd).all()
    p_pair = b * (b - 1) / (m * (m - 1))
    assert abs(pair / runs - p_pair) < 5 * math.sqrt(p_pair * (1 - p_pair) / runs)


@pytest.mark.parametrize("m, b, message", [
    (10, 11, r"batch_size=11: must be an integer in \[1, records=10\]"),
    (10, 0, r"batch_size=0"),
    (0, 1, r"records=0: must be an integer >= 1"),
])
def test_sample_batch_bad_arguments(m, b, message):
    with pytest.raises(ValueError, match=message):
        sample_batch(m, b, noise_generator(0))


def test_noise_generator_seeding():
    prod = ProductManifold({"h": Euclidean(8)})
    params = {"h": torch.zeros(8)}
    a, b = noise_generator(None), noise_generator(None)
    assert not torch.equal(standard_noise(prod, params, a)["h"], standard_noise(prod, params, b)["h"])
    c, d = noise_generator(42), noise_generator(42)
    assert torch.equal(standard_noise(prod, params, c)["h"], standard_noise(prod, params, d)["h"])
    for bad in (-1, 1.5, "7", True, 2**128):
        with pytest.raises(ValueError, match="seed="):
            noise_generator(bad)


def fedpca_minibatch(dtype, seed=0, batch=64, d=12, p=3):
    """A point of Gr(d, p) and records of very different norms (clipping binds for some), one of
    them adversarially large."""
    from rfedray.models.fedpca import FedPCA

    model = FedPCA(d, p, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    params = {k: v.to(dtype) for k, v in model.init_params(gen).items()}
    z = torch.randn(batch, d, dtype=torch.float64, generator=gen) * torch.logspace(-1, 1, batch, dtype=torch.float64)[:, None]
    z[7] *= 1e4
    return model, ProductManifold(model.groups), params, (z.to(dtype),)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_fedpca_gradient_rule_equals_the_generic_per_sample_path(dtype, tol):
    """The closed-form rule (norms sqrt2 ||Pz|| ||(I-P)z||, sum -Z^T diag(w) Z) gives the vmap(grad)
    path's privatised gradient, with clipping binding for some records and not others."""
    model, prod, params, records = fedpca_minibatch(dtype)
    grads = per_sample_gradients(model.per_sample_loss, params, records)
    norms = prod.norm(prod.proj_tangent(params, grads))
    torch.testing.assert_close(model.gradient_rule.tangent_norms(params, records), norms, rtol=tol, atol=0)
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    generic = private_gradient(model.per_sample_loss, params, prod, records, clip=clip, sigma=0.3,
                               noise=standard_noise(prod, params, noise_generator(5)))
    ruled = private_gradient(model.per_sample_loss, params, prod, records, clip=clip, sigma=0.3,
                             noise=standard_noise(prod, params, noise_generator(5)), rule=model.gradient_rule)
    scale = float(prod.norm(generic))
    torch.testing.assert_close(ruled["subspace"], generic["subspace"], rtol=0, atol=tol * scale)


def test_fedpca_gradient_rule_keeps_the_sensitivity_and_drops_non_finite_records():
    model, prod, params, (z,) = fedpca_minibatch(torch.float64)
    clip, batch = 0.2, z.shape[0]
    z2 = z.clone()
    z2[3] = 1e6
    z3 = z.clone()
    z3[3] = float("nan")

    def step(records):
        return private_gradient(model.per_sample_loss, params, prod, records, clip=clip, sigma=0.7,
                                noise=standard_noise(prod, params, noise_generator(3)), rule=model.gradient_rule)

    a, b, c = step((z,)), step((z2,)), step((z3,))
    gap = float(prod.norm({k: a[k] - b[k] for k in a}))
    assert 0.0 < gap <= 2 * clip / batch + 1e-12
    assert torch.isfinite(c["subspace"]).all()
    gap = float(prod.norm({k: a[k] - c[k] for k in a}))
    assert 0.0 < gap <= clip / batch + 1e-12
