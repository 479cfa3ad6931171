"""Cost of a private local step against the non-private one: federated PCA, SPDNet and EEGNet.

Private step: per-sample gradients by ``vmap(grad(per_sample_loss))`` (or the model's closed-form
``gradient_rule``, as the clients use it: federated PCA), tangent projection, joint clipping and
Gaussian noise (:func:`rfedray.privacy.mechanism.private_gradient`), then
``theta <- Pi(theta - lr g)``. Non-private step: one batched forward and ``torch.autograd.grad``
of the mean loss, tangent projection, the same update. Both run in the same process, interleaved,
and the ratio of their medians (and of their minima, less sensitive to other load on shared
cores) is reported with the goal: federated PCA on Gr(40, 4), batch 500 (the paper's Table 4):
<= 2x; SPDNet 22 -> 16, batch 64: <= 2x; EEGNet on 22 x 513 trials, batch 64: <= 3x.

``--clock cpu`` times with the process's CPU time instead of the wall clock: on shared, loaded
cores that measures the work of the step and not the waits for a core.

Run: ``python benchmarks/bench_eeg_step.py [--repeats 30] [--threads N] [--dtype float32] [--clock wall|cpu]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rfedray.geometry import ProductManifold
from rfedray.models.eegnet import EEGNet
from rfedray.models.fedpca import GROUP, FedPCA
from rfedray.models.spdnet import SPDNet
from rfedray.privacy.mechanism import noise_generator, private_gradient, standard_noise


@dataclass(frozen=True)
class Case:
    """A model, a minibatch and the batched mean loss of its non-private step.

    Attributes
    ----------
    name : str
    model : FederatedModel
    records : tuple of Tensor
        The minibatch, each of shape ``(B, ...)``.
    mean_loss : callable
        ``mean_loss(params, *records)``: the minibatch's mean loss by one batched forward.
    clip, sigma : float
        Of the private step.
    goal : float
        The private/non-private time ratio to stay under.
    """

    name: str
    model: object
    records: tuple
    mean_loss: Callable
    clip: float
    sigma: float
    goal: float


def fedpca_case(dtype: torch.dtype, batch: int, generator: torch.Generator) -> Case:
    """Federated PCA on Gr(40, 4), unit-norm records (Table 4's model)."""
    model = FedPCA(40, 4, dtype=dtype)
    z = torch.randn(batch, 40, generator=generator, dtype=torch.float64)
    z = (z / z.norm(dim=1, keepdim=True)).to(dtype)

    def mean_loss(params, records):
        return -((records @ params[GROUP]) * records).sum(-1).mean()

    return Case(f"FedPCA Gr(40,4), B={batch}", model, (z,), mean_loss, 0.3548, 0.02, 2.0)


def spdnet_case(dtype: torch.dtype, batch: int, generator: torch.Generator) -> Case:
    """SPDNet 22 -> 16 on random normalised covariances, 4 classes."""
    model = SPDNet(22, 4, 16, 8e-5, dtype=dtype)
    a = torch.randn(batch, 22, 66, generator=generator, dtype=torch.float64)
    x = (a @ a.transpose(-1, -2) / 66).to(dtype)
    y = torch.randint(0, 4, (batch,), generator=generator)
    return Case(f"SPDNet 22->16, B={batch}", model, (x, y), classification_loss(model), 1.0, 0.1, 2.0)


def eegnet_case(dtype: torch.dtype, batch: int, generator: torch.Generator) -> Case:
    """EEGNet on 22 x 513 trials in microvolts, 4 classes."""
    model = EEGNet(22, 513, 4, dtype=dtype)
    x = (20 * torch.randn(batch, 22, 513, generator=generator, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, 4, (batch,), generator=generator)
    return Case(f"EEGNet 22x513, B={batch}", model, (x, y), classification_loss(model), 1.0, 0.1, 3.0)


def classification_loss(model) -> Callable:
    def mean_loss(params, x, y):
        return F.cross_entropy(model.logits(params, x), y)

    return mean_loss


CASES = {"fedpca": (fedpca_case, 500), "spdnet": (spdnet_case, 64), "eegnet": (eegnet_case, 64)}
"""Case builders and their default batch sizes."""


def steps(case: Case, generator: torch.Generator, device: str = "cpu") -> tuple[Callable, Callable]:
    """The private and the non-private local step of ``case`` from a fixed random point, on ``device``.

    Both return only after the device has finished the step.
    """
    model = case.model
    product = ProductManifold(model.groups)
    params = {g: v.to(device) for g, v in model.init_params(generator).items()}
    records = tuple(r.to(device) for r in case.records)
    noise = noise_generator(int(torch.randint(0, 2**62, (1,), generator=generator)), device)

    def update(grads):
        return product.project({g: params[g] - 0.01 * grads[g] for g in params})

    def private():
        out = update(private_gradient(model.per_sample_loss, params, product, records,
                                      clip=case.clip, sigma=case.sigma, noise=standard_noise(product, params, noise),
                                      rule=model.gradient_rule))
        synchronize(device)
        return out

    def nonprivate():
        live = {g: p.detach().requires_grad_(True) for g, p in params.items()}
        loss = case.mean_loss(live, *records)
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        out = update(product.proj_tangent(params, grads))
        synchronize(device)
        return out

    return private, nonprivate


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_ms(fn: Callable, times: list[float], clock: Callable[[], float]) -> None:
    start = clock()
    fn()
    times.append(1e3 * (clock() - start))


def measure_case(name: str, repeats: int, dtype: torch.dtype = torch.float32, clock: str = "wall",
                 batch: int | None = None, seed: int = 0, device: str = "cpu") -> dict:
    """Private and non-private step times of one case, interleaved in this process.

    Parameters
    ----------
    name : str
        A key of :data:`CASES`.
    repeats : int
        Timed steps of each kind (after 3 untimed ones).
    dtype : torch.dtype
    clock : str
        A key of :data:`CLOCKS` (``wall`` on a GPU: the CPU time of a process waiting for its GPU
        is not the step's time).
    batch : int or None
        The case's default batch size when None.
    seed : int
    device : str
        Torch device of the model, the minibatch and the noise generator.

    Returns
    -------
    dict
        ``case``, ``params`` (ambient count), ``nonprivate_ms`` and ``private_ms`` (medians),
        ``ratio`` (of the medians), ``ratio_min`` (of the minima) and ``goal``.
    """
    build, default_batch = CASES[name]
    generator = torch.Generator().manual_seed(seed)
    case = build(dtype, batch or default_batch, generator)
    private, nonprivate = steps(case, generator, device)
    for _ in range(3):
        private(), nonprivate()
    t_priv, t_non = [], []
    for _ in range(repeats):
        timed_ms(private, t_priv, CLOCKS[clock])
        timed_ms(nonprivate, t_non, CLOCKS[clock])
    p, n = statistics.median(t_priv), statistics.median(t_non)
    return {"case": case.name, "params": ProductManifold(case.model.groups).ambient_dim, "nonprivate_ms": n,
            "private_ms": p, "ratio": p / n, "ratio_min": min(t_priv) / min(t_non), "goal": case.goal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure_case(name, args.repeats, getattr(torch, args.dtype), args.clock) for name in args.cases]
    print(f"{args.dtype}, {args.threads} thread(s), {args.clock} clock, {args.repeats} interleaved steps (median; min)")
    print(f"{'model':<26}{'params':>8}{'non-private ms':>16}{'private ms':>12}{'ratio':>8}{'ratio(min)':>12}"
          f"{'goal':>7}")
    for r in rows:
        print(f"{r['case']:<26}{r['params']:>8}{r['nonprivate_ms']:>16.2f}{r['private_ms']:>12.2f}{r['ratio']:>7.2f}x"
              f"{r['ratio_min']:>11.2f}x{'<=' + format(r['goal'], 'g') + 'x':>7}")


if __name__ == "__main__":
    main()
