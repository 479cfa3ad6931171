"""EEGNet: parameter counts of Table 13, functional evaluation and per-sample gradients."""

import math

import pytest
import torch
from torch.func import grad, vmap

from rfedray import registry
from rfedray.options import OptionsError
from rfedray.models import eegnet
from rfedray.models.eegnet import EEGNet, EEGNetModule, same_padding
from rfedray.task import EvalData



def info(channels, n_times, classes, dtype="float64"):
    return {"channels": channels, "n_times": n_times, "num_classes": classes, "dtype": dtype, "representation": "raw"}


@pytest.mark.parametrize(
    "channels, n_times, classes, expected",
    [(22, 513, 4, 2404), (64, 384, 2, 2434), (60, 513, 7, 3783)],
    ids=["BNCI2014_001", "Cho2017", "Weibo2014"],
)
def test_parameter_counts_match_table_13(channels, n_times, classes, expected):
    model = eegnet.build(eegnet.Options(), info(channels, n_times, classes))
    assert model.num_parameters == expected
    assert model.groups["net"].shape == (expected,)
    assert sum(p.numel() for p in EEGNetModule(channels, n_times, classes).parameters()) == expected


@pytest.mark.parametrize("length", [1, 16, 63, 64])
def test_same_padding_keeps_the_length(length):
    conv = torch.nn.Sequential(torch.nn.ZeroPad2d(same_padding(length)), torch.nn.Conv2d(1, 1, (1, length)))
    assert conv(torch.zeros(1, 1, 3, 100)).shape[-1] == 100


def test_functional_call_matches_the_module():
    g = torch.Generator().manual_seed(0)
    model = EEGNet(6, 96, 3, dtype=torch.float64)
    params = model.init_params(g)
    module = EEGNetModule(6, 96, 3).double()
    module.load_state_dict(model.unflatten(params["net"]))
    x = torch.randn(5, 6, 96, generator=g, dtype=torch.float64) * 20
    torch.testing.assert_close(model.logits(params, x), module(x[:, None]))
    assert model.logits(params, x[0]).shape == (3,)


def test_init_is_deterministic_and_bounded_by_fan_in():
    model = EEGNet(22, 513, 4)
    a = model.init_params(torch.Generator().manual_seed(1))["net"]
    b = model.init_params(torch.Generator().manual_seed(1))["net"]
    torch.testing.assert_close(a, b)
    for (name, _), part, fan in zip(model.layout, torch.split(a, model.sizes), model.fan_ins):
        assert part.abs().max() <= 1 / math.sqrt(fan), name
    assert dict(zip([n for n, _ in model.layout], model.fan_ins))["temporal.weight"] == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_per_sample_gradients_equal_a_loop(dtype):
    g = torch.Generator().manual_seed(2)
    model = EEGNet(8, 128, 3, dtype=dtype)
    params = model.init_params(g)
    x = (torch.randn(12, 8, 128, generator=g, dtype=torch.float64) * 15).to(dtype)
    y = torch.randint(0, 3, (12,), generator=g)
    batched = vmap(grad(model.per_sample_loss), in_dims=(None, 0, 0))(params, x, y)["net"]
    loop = torch.stack([grad(model.per_sample_loss)(params, xi, yi)["net"] for xi, yi in zip(x, y)])
    assert batched.shape == (12, model.num_parameters)
    torch.testing.assert_close(batched, loop)


def test_per_sample_gradient_matches_module_autograd():
    """Independent reference: the plain module's backward, one record at a time."""
    g = torch.Generator().manual_seed(3)
    model = EEGNet(5, 64, 2, dtype=torch.float64)
    params = model.init_params(g)
    module = EEGNetModule(5, 64, 2).double()
    module.load_state_dict(model.unflatten(params["net"]))
    x = torch.randn(4, 5, 64, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    ours = vmap(grad(model.per_sample_loss), in_dims=(None, 0, 0))(params, x, y)["net"]
    for i in range(4):
        module.zero_grad()
        torch.nn.functional.cross_entropy(module(x[i : i + 1, None]), y[i : i + 1]).backward()
        ref = torch.cat([p.grad.flatten() for p in module.parameters()])
        torch.testing.assert_close(ours[i], ref)


def test_scale_invariance_of_microvolt_inputs():
    """GroupNorm after the first (linear) conv makes the output invariant to the input scale, as
    long as the feature variance dominates GroupNorm's eps (1e-5): true in microvolts, not in volts."""
    g = torch.Generator().manual_seed(4)
    model = EEGNet(4, 64, 2, dtype=torch.float64)
    params = model.init_params(g)
    x = torch.randn(3, 4, 64, generator=g, dtype=torch.float64) * 10
    torch.testing.assert_close(model.logits(params, x), model.logits(params, 5 * x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model.logits(params, x), model.logits(params, 1e-6 * x), atol=1e-3)


def test_a_few_steps_reduce_the_loss():
    g = torch.Generator().manual_seed(5)
    model = EEGNet(4, 64, 2, dtype=torch.float32)
    params = model.init_params(g)
    y = torch.arange(32) % 2
    x = torch.randn(32, 4, 64, generator=g) * (1 + 2 * y[:, None, None] * (torch.arange(4) == 0)[None, :, None])
    loss = lambda p: vmap(model.per_sample_loss, in_dims=(None, 0, 0))(p, x, y).mean()
    start = float(loss(params))
    for _ in range(30):
        params = {"net": params["net"] - 0.1 * grad(loss)(params)["net"]}
    assert float(loss(params)) < start
    assert model.evaluate(params, EvalData((x, y)))["accuracy"] > 0.5


def test_options_and_build_errors():
    with pytest.raises(OptionsError, match="model.options.norm_groups"):
        eegnet.Options(norm_groups=3).validate("model.options")
    with pytest.raises(OptionsError, match="representation"):
        eegnet.build(eegnet.Options(), {**info(22, 513, 4), "representation": "covariance"})
    with pytest.raises(ValueError, match="n_times"):
        EEGNet(4, 16, 2)
    assert registry.resolve_options(registry.model_module("eegnet"), {"norm_groups": 2}, "model.options").norm_groups == 2
