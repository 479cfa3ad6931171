"""Item 5 of issue 16: a finite but extreme record must not turn a private release into NaN.

``[1e160, 0, 0]`` passes every input check (it is finite), but its per-record Hessian overflows.
Before, ``0 * inf`` in the clipping weight made FedNewton's privatised Hessian NaN exactly when the
record was sampled: a membership signal in the release. Like ``private_gradient``, the Hessian step
now lets such a record contribute zero (a valid clipped value).
"""

import torch

from rfedray.federated.engine import HostedClient
from rfedray.mestimation.local import StepPlan, private_hessian
from rfedray.mestimation.strategies import LocalNewtonTask
from rfedray.models.logreg import LogisticRegression
from rfedray.models.mlp import MLP
from rfedray.privacy.mechanism import noise_generator
from rfedray.task import ClientData

EXTREME = torch.tensor([1e160, 0.0, 0.0], dtype=torch.float64)


def records(n=16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (n,), generator=g)
    return x, y


def test_the_extreme_record_contributes_zero_to_the_privatised_hessian():
    model = LogisticRegression(3, 2, l2=0.0)
    params = model.init_params(torch.Generator().manual_seed(0))
    x, y = records()
    hostile = x.clone()
    hostile[0] = EXTREME
    with_extreme = private_hessian(model, params, (hostile, y), clip=1.0, sigma=0.1, generator=noise_generator(1))
    assert torch.isfinite(with_extreme).all()
    # Zero contribution: the same as the record given weight 0 by hand (the others' clipped sum over B, same noise).
    norms = model.per_sample_hessian_norms(params, x, y)
    weights = (1.0 / norms).clamp(max=1.0) / x.shape[0]
    weights[0] = 0.0
    mean = model.weighted_hessian_sum(params, weights, x, y)
    noise = noise_generator(1).standard_normal(mean.shape)
    expected = mean + 0.1 * noise
    assert torch.allclose(with_extreme, 0.5 * (expected + expected.mT), atol=1e-12)


def test_generic_hessians_mask_it_too():
    model = MLP(3, [4], 1, task="regression")
    params = model.init_params(torch.Generator().manual_seed(0))
    x, _ = records()
    x[0] = EXTREME
    y = torch.randn(x.shape[0], dtype=torch.float64)
    assert torch.isfinite(private_hessian(model, params, (x, y), clip=1.0, sigma=0.1, generator=noise_generator(2))).all()


def test_a_fednewton_client_holding_the_record_releases_a_finite_model():
    """B = m: the record is in every minibatch; the client's released Newton iterate stays finite."""
    model = LogisticRegression(3, 2, l2=0.0)
    x, y = records()
    x[0] = EXTREME
    client = HostedClient(0, ClientData((x, y)), model)
    task = LocalNewtonTask(StepPlan(batch_size=16, clip=1.0, noise_multiplier=1.0, noise_seed=5), newton_steps=2,
                           hessian_clip=1.0, damping=1.0, floor=0.1)
    released = task(client, model.init_params(torch.Generator().manual_seed(0)), round_index=0)
    assert all(torch.isfinite(v).all() for v in released.values())
