"""Item 1 of issue 16: the noise and the minibatches cannot be recomputed by the server.

The randomness of every private release comes from :mod:`rfedray.privacy.randomness` (a ChaCha20
keystream under a 256-bit key): seeds of up to 128 bits all count, uniforms carry 53 bits, and the
Gaussian noise is drawn in float64 and only cast after scaling, so its tail is a Gaussian's.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from rfedray.config import ConfigError, load_config
from rfedray.federated.client import round_generator
from rfedray.geometry import Euclidean, ProductManifold
from rfedray.privacy.mechanism import draw_step, noise_generator, private_gradient, sample_batch, standard_noise

SEED = 123456789
ABOVE_32_BITS = SEED + 7 * 2**32  # torch's CPU generator keeps the low 32 bits of a seed: the same stream there


def linear_loss(params, z):
    return (params["h"] * z).sum()


def one_private_step(seed: int) -> torch.Tensor:
    """The privatised gradient of a step whose minibatch and noise come from ``noise_generator(seed)``."""
    gen = noise_generator(seed)
    records = torch.linspace(-1, 1, 50 * 4, dtype=torch.float32).view(50, 4)
    batch = records[sample_batch(50, 10, gen)]
    prod = ProductManifold({"h": Euclidean(4)})
    params = {"h": torch.zeros(4)}
    return private_gradient(linear_loss, params, prod, (batch,), clip=1.0, sigma=1.0,
                            noise=standard_noise(prod, params, gen))["h"]


def test_seeds_differing_above_bit_32_give_different_minibatches_and_noise():
    """A server scanning 2^32 seeds must not find the generator of a seeded run."""
    assert not torch.equal(sample_batch(1000, 100, noise_generator(SEED)), sample_batch(1000, 100, noise_generator(ABOVE_32_BITS)))
    assert not torch.equal(one_private_step(SEED), one_private_step(ABOVE_32_BITS))
    assert torch.equal(one_private_step(SEED), one_private_step(SEED))


@pytest.mark.parametrize("bit", [0, 31, 32, 63, 64, 100, 127])
def test_every_bit_of_a_128_bit_seed_changes_the_stream(bit):
    seed = (2**128 - 1) ^ (1 << 77)
    flipped = seed ^ (1 << bit)
    prod = ProductManifold({"h": Euclidean(16)})
    params = {"h": torch.zeros(16, dtype=torch.float64)}
    for a, b in ((noise_generator(seed), noise_generator(flipped)),
                 (round_generator(seed, 3, 5), round_generator(flipped, 3, 5))):
        assert not torch.equal(standard_noise(prod, params, a)["h"], standard_noise(prod, params, b)["h"])


def test_round_generators_of_clients_and_rounds_are_distinct_and_reproducible():
    prod = ProductManifold({"h": Euclidean(16)})
    params = {"h": torch.zeros(16)}
    draws = {(c, t): standard_noise(prod, params, round_generator(SEED, c, t))["h"] for c in range(3) for t in range(3)}
    assert len({tuple(v.tolist()) for v in draws.values()}) == 9
    assert torch.equal(draws[(1, 2)], standard_noise(prod, params, round_generator(SEED, 1, 2))["h"])


def test_noise_seed_accepts_128_bit_integers_and_no_more():
    cfg = load_config(None, [f"privacy.noise_seed={2**128 - 1}"])
    assert cfg.privacy.noise_seed == 2**128 - 1
    with pytest.raises(ConfigError, match=r"privacy.noise_seed=.*\[0, 2\^128\)"):
        load_config(None, [f"privacy.noise_seed={2**128}"])
    noise_generator(2**128 - 1)
    with pytest.raises(ValueError, match="seed="):
        noise_generator(2**128)


def test_noise_is_drawn_in_float64_with_53_bit_uniforms():
    """A float32 model's noise is a float64 draw (scaled, then cast): a float32 draw would come from
    24-bit uniforms and be a Gaussian truncated at 5.77 standard deviations."""
    gen = noise_generator(SEED)
    noise = standard_noise(ProductManifold({"h": Euclidean(20000)}), {"h": torch.zeros(20000, dtype=torch.float32)}, gen)["h"]
    assert noise.dtype == torch.float64
    u = gen.uniform(100000).numpy()
    k = u * 2.0**53
    assert np.array_equal(k, np.floor(k)) and u.min() >= 0 and u.max() < 1
    # The bits below 2^-24 are random too: the lowest of the 53 is set about half the time.
    low_bit = np.mod(k, 2).mean()
    assert abs(low_bit - 0.5) < 5 * math.sqrt(0.25 / k.size)
    assert np.mean(np.mod(k, 2.0**29) != 0) > 0.999


def test_private_step_scales_the_noise_in_float64_before_the_cast():
    prod = ProductManifold({"h": Euclidean(6)})
    params = {"h": torch.zeros(6, dtype=torch.float32)}
    records = (torch.zeros(4, 6, dtype=torch.float32),)
    sigma = 0.3
    out = private_gradient(linear_loss, params, prod, records, clip=1.0, sigma=sigma,
                           noise=standard_noise(prod, params, noise_generator(SEED)))["h"]
    expected = (sigma * noise_generator(SEED).standard_normal((6,))).to(torch.float32)
    assert torch.equal(out, expected)


def test_box_muller_reaches_the_tail_of_53_bit_uniforms():
    """The largest radius the transform gives is sqrt(-2 ln 2^-53) = 8.57 standard deviations."""
    gen = noise_generator(SEED)
    gen.words = lambda count: np.array([2**64 - 1, 0] * (count // 2), dtype=np.uint64)  # u = 1 - 2^-53, v = 0
    z = gen.standard_normal((2,))
    assert float(z[0]) == pytest.approx(math.sqrt(106 * math.log(2)), rel=1e-12)
    assert float(z[0]) > 8.5


def test_standard_normal_is_gaussian():
    """Kolmogorov-Smirnov against N(0, 1), and the 4-sigma tail count against its binomial law."""
    z = noise_generator(SEED).standard_normal((2_000_000,)).numpy()
    assert stats.kstest(z[:200_000], "norm").pvalue > 1e-4
    p4 = 2 * stats.norm.sf(4.0)
    count = int((np.abs(z) > 4.0).sum())
    assert abs(count - z.size * p4) < 5 * math.sqrt(z.size * p4)


def test_laplace_is_laplace():
    x = noise_generator(SEED).laplace((200_000,), 2.0).numpy()
    assert stats.kstest(x, "laplace", args=(0, 2.0)).pvalue > 1e-4


def test_subset_is_uniform_over_pairs():
    """Every pair of records is in a minibatch with probability B(B-1)/(m(m-1)) (exact subset sampling)."""
    gen = noise_generator(SEED)
    m, b, runs = 6, 2, 30000
    counts = np.zeros((m, m))
    for _ in range(runs):
        i, j = sorted(sample_batch(m, b, gen).tolist())
        counts[i, j] += 1
    expected = runs / math.comb(m, b)
    observed = counts[np.triu_indices(m, 1)]
    assert stats.chisquare(observed, [expected] * observed.size).pvalue > 1e-4


@pytest.mark.slow
def test_gaussian_tail_beyond_float32_truncation():
    """In 1e9 draws a true Gaussian exceeds |z| = 5.77 about 7.9 times (P(none) = 4e-4); float32 draws
    from 24-bit uniforms never do. The counts beyond 5 and 5.77 follow the Gaussian's Poisson law."""
    gen = noise_generator(SEED)
    prod = ProductManifold({"h": Euclidean(10_000_000)})
    params = {"h": torch.zeros(10_000_000, dtype=torch.float32)}
    beyond5 = beyond577 = 0
    chunks = 100
    for _ in range(chunks):
        z = standard_noise(prod, params, gen)["h"].abs()
        beyond5 += int((z > 5.0).sum())
        beyond577 += int((z > 5.77).sum())
    n = chunks * 10_000_000
    for count, level in ((beyond5, 5.0), (beyond577, 5.77)):
        mean = n * 2 * stats.norm.sf(level)
        low, high = stats.poisson.ppf(1e-4, mean), stats.poisson.isf(1e-4, mean)
        assert low <= count <= high, (level, count, mean)
    assert beyond577 >= 1


@pytest.mark.parametrize("sizes", [[1000] * 10, [37, 50, 37, 1000], [12]])
@pytest.mark.parametrize("private", [True, False])
def test_draws_of_clients_together_are_each_clients_own_draws(sizes, private):
    """draw_step reads every generator's stream as sample_batch then standard_noise do for that
    generator alone (equal sizes or not, several groups, an odd count): the same bits, and the
    stream then goes on where the client alone would be."""
    prod = ProductManifold({"a": Euclidean(7, 3), "b": Euclidean(40, 4), "c": Euclidean(1)})
    params = {g: torch.zeros(m.shape) for g, m in prod.groups.items()}
    together = [noise_generator(SEED, context=(i, 3)) for i in range(len(sizes))]
    alone = [noise_generator(SEED, context=(i, 3)) for i in range(len(sizes))]
    for _ in range(2):
        index, noise = draw_step(sizes, 12, prod if private else None, params, together)
        assert index.shape == (len(sizes), 12) and index.dtype == torch.int64
        assert (noise is None) == (not private)
        for i, (m, gen) in enumerate(zip(sizes, alone)):
            assert torch.equal(index[i], sample_batch(m, 12, gen))
            if private:
                own = standard_noise(prod, params, gen)
                assert all(noise[g].dtype == torch.float64 and torch.equal(noise[g][i], own[g]) for g in prod.groups)
    assert all(np.array_equal(a.words(5), b.words(5)) for a, b in zip(together, alone))


def test_draws_of_clients_together_check_the_batch_size_and_the_device():
    gens = [noise_generator(SEED, context=(i,)) for i in range(2)]
    with pytest.raises(ValueError, match="batch_size"):
        draw_step([20, 10], 11, None, {}, gens)
    with pytest.raises(ValueError, match="one device"):
        draw_step([20, 10], 5, None, {}, [gens[0], noise_generator(SEED, "meta", context=(1,))])


@pytest.mark.gpu
def test_cuda_draws_equal_the_cpu_draws():
    prod = ProductManifold({"h": Euclidean(64)})
    cpu = standard_noise(prod, {"h": torch.zeros(64)}, noise_generator(SEED))["h"]
    gpu = standard_noise(prod, {"h": torch.zeros(64, device="cuda")}, noise_generator(SEED, "cuda"))["h"]
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    index = sample_batch(1000, 10, noise_generator(SEED, "cuda"))
    assert index.device.type == "cuda" and torch.equal(index.cpu(), sample_batch(1000, 10, noise_generator(SEED)))
