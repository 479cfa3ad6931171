"""Cost of the cryptographic noise source in the private step: ChaCha20 draws against torch's MT19937.

A federated-PCA client of the paper's Table 4 (Gr(40, 4) or St(40, 4), m = 5000, B = 500, tau = 10)
runs :meth:`~rfedray.federated.client.Client.local_train` with its round generator from
:func:`~rfedray.federated.client.round_generator` (a ChaCha20 keystream:
:mod:`rfedray.privacy.randomness`, drawn by :func:`~rfedray.privacy.mechanism.draw_step`), and again
with the draws rfedray made before, torch's generator (``randperm`` minibatches, ``randn`` noise in
the model's dtype, a 32-bit seed: not safe, kept here as the baseline only). Rounds of the two alternate in this process; the CPU time per
local step (median and minimum over rounds) and their ratio are printed.

Run: ``python benchmarks/bench_noise_source.py [--rounds 40] [--manifold grassmann stiefel]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rfedray.federated.client as client_module
from rfedray.config import load_config
from rfedray.federated.setup import build_client, build_dataset, build_model, initial_params, local_plan, resolve_privacy


class TorchDraws:
    """The draws of torch's CPU generator, seeded with ``seed`` (MT19937: 32 bits of it count)."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def subset(self, num_records: int, size: int) -> torch.Tensor:
        return torch.randperm(num_records, generator=self.generator)[:size]

    def standard_normal(self, shape) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.generator, dtype=self.dtype)


def torch_draw_step(num_records, batch_size, product, params, generators):
    """:func:`~rfedray.privacy.mechanism.draw_step` with :class:`TorchDraws` generators: each client's
    minibatch, then its noise, stacked."""
    index = torch.stack([g.subset(m, batch_size) for g, m in zip(generators, num_records)])
    if product is None:
        return index, None
    return index, {name: torch.stack([g.standard_normal(params[name].shape) for g in generators])
                   for name in product.groups}


def measure(manifold: str, rounds: int) -> dict:
    """Median and minimum CPU milliseconds per private local step with each source."""
    cfg = load_config(None, [
        "run.engine=local", "data.options.d=40", "data.options.p=4", "data.options.records_per_client=5000",
        "federation.batch_size=500", "federation.local_steps=10", "federation.n_clients=2",
        "federation.clients_per_round=1", f"model.options.manifold={manifold}", "privacy.sigma=0.02",
        "privacy.epsilon=null",
    ])
    dataset = build_dataset(cfg)
    model = build_model(cfg, dataset.info)
    client = build_client(cfg, 0, dataset, model, local_plan(cfg, resolve_privacy(cfg, dataset.client_sizes())))
    theta = initial_params(cfg, model)
    dtype = next(iter(theta.values())).dtype
    sources = {"chacha20": (client_module.round_generator, client_module.draw_step),
               "torch": (lambda seed, client_id, round_index, device="cpu": TorchDraws(round_index, dtype),
                         torch_draw_step)}

    def step_ms(source: str, round_index: int) -> float:
        client_module.round_generator, client_module.draw_step = sources[source]
        start = time.process_time()
        client.local_train(theta, round_index)
        return 1e3 * (time.process_time() - start) / cfg.federation.local_steps

    times: dict[str, list[float]] = {name: [] for name in sources}
    try:
        for r in range(rounds + 3):
            for name in sources:
                ms = step_ms(name, r)
                if r >= 3:
                    times[name].append(ms)
    finally:
        client_module.round_generator, client_module.draw_step = sources["chacha20"]
    new, old = statistics.median(times["chacha20"]), statistics.median(times["torch"])
    return {"manifold": manifold, "chacha20_ms": new, "torch_ms": old, "ratio": new / old,
            "ratio_min": min(times["chacha20"]) / min(times["torch"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--manifold", nargs="+", default=["grassmann", "stiefel"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for manifold in args.manifold:
        r = measure(manifold, args.rounds)
        print(f"{manifold}: private step {r['torch_ms']:.3f} ms with torch's generator, {r['chacha20_ms']:.3f} ms with "
              f"ChaCha20: {r['ratio']:.2f}x (minima {r['ratio_min']:.2f}x)")


if __name__ == "__main__":
    main()
