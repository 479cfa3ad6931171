"""Cost of a private local step against the non-private one, for SPDNet and EEGNet.

Private step: per-sample gradients by ``vmap(grad(per_sample_loss))``, tangent projection, joint
clipping and Gaussian noise (:func:`rfedray.privacy.mechanism.private_gradient`), then
``theta <- Pi(theta - lr g)``. Non-private step: one batched forward and ``torch.autograd.grad``
of the mean loss, tangent projection, the same update. Both run in the same process, interleaved,
and the ratio of their medians (and of their minima, less sensitive to other load on shared
cores) is reported with the goal (SPDNet 22 -> 16: <= 2x; EEGNet on
22 x 513 trials: <= 3x), batch 64.

``--clock cpu`` times with the process's CPU time instead of the wall clock: on shared, loaded
cores that measures the work of the step and not the waits for a core.

Run: ``python benchmarks/bench_eeg_step.py [--repeats 30] [--threads N] [--dtype float32] [--clock wall|cpu]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from rfedray.geometry import ProductManifold
from rfedray.models.eegnet import EEGNet
from rfedray.models.spdnet import SPDNet
from rfedray.privacy.mechanism import private_gradient


def spdnet_case(dtype: torch.dtype, batch: int, generator: torch.Generator):
    model = SPDNet(22, 4, 16, 8e-5, dtype=dtype)
    a = torch.randn(batch, 22, 66, generator=generator, dtype=torch.float64)
    x = (a @ a.transpose(-1, -2) / 66).to(dtype)
    return model, x


def eegnet_case(dtype: torch.dtype, batch: int, generator: torch.Generator):
    model = EEGNet(22, 513, 4, dtype=dtype)
    return model, (20 * torch.randn(batch, 22, 513, generator=generator, dtype=torch.float64)).to(dtype)


def steps(model, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> tuple[Callable, Callable]:
    product = ProductManifold(model.groups)
    params = model.init_params(generator)

    def update(grads):
        return product.project({g: params[g] - 0.01 * grads[g] for g in params})

    def private():
        return update(private_gradient(model.per_sample_loss, params, product, (x, y), clip=1.0, sigma=0.1, generator=generator))

    def nonprivate():
        live = {g: p.detach().requires_grad_(True) for g, p in params.items()}
        loss = F.cross_entropy(model.logits(live, x), y)
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        return update(product.proj_tangent(params, grads))

    return private, nonprivate


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_ms(fn: Callable, times: list[float], clock: Callable[[], float]) -> None:
    start = clock()
    fn()
    times.append(1e3 * (clock() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)

    rows = []
    for name, case, goal in [("SPDNet 22->16, K=4", spdnet_case, 2.0), ("EEGNet 22x513, K=4", eegnet_case, 3.0)]:
        model, x = case(dtype, args.batch, generator)
        y = torch.randint(0, 4, (args.batch,), generator=generator)
        private, nonprivate = steps(model, x, y, generator)
        for _ in range(3):
            private(), nonprivate()
        t_priv, t_non = [], []
        for _ in range(args.repeats):
            timed_ms(private, t_priv, CLOCKS[args.clock])
            timed_ms(nonprivate, t_non, CLOCKS[args.clock])
        p, n = statistics.median(t_priv), statistics.median(t_non)
        rows.append((name, model.num_parameters, n, p, p / n, min(t_priv) / min(t_non), goal))

    print(f"batch {args.batch}, {args.dtype}, {args.threads} thread(s), {args.clock} clock, {args.repeats} interleaved steps (median; min)")
    print(f"{'model':<22}{'params':>8}{'non-private ms':>16}{'private ms':>12}{'ratio':>8}{'ratio(min)':>12}{'goal':>7}")
    for name, count, n, p, ratio, ratio_min, goal in rows:
        print(f"{name:<22}{count:>8}{n:>16.2f}{p:>12.2f}{ratio:>7.2f}x{ratio_min:>11.2f}x{'<=' + format(goal, 'g') + 'x':>7}")


if __name__ == "__main__":
    main()
