"""Your own model and data: an SPDNet with a geoopt Stiefel parameter, trained with record-level DP
on covariance matrices that every client loads from its own file.

    python examples/custom_model.py                  # the local engine
    python examples/custom_model.py --engine ray     # client actors load their clients' files

The same model and data from a configuration, by import path (this folder on ``PYTHONPATH``, or the
module in an installed package; on Ray the module travels to every node)::

    model: {name: "custom_model:spdnet", options: {d: 3}}
    data:  {source: "custom_model:CovarianceFiles", options: {folder: /where/the/files/are}}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import geoopt
import torch
import torch.nn.functional as F
from torch import nn

import rfedray
from rfedray.models.spdnet import vech
from rfedray.spectral import sym_clamped_log


class SPDNet(nn.Module):
    """``X -> head(vech(log(max(W^T X W, eps))))`` with ``W`` on the Stiefel manifold ``St(C, d)``."""

    def __init__(self, channels: int, d: int, num_classes: int, eps: float = 1e-4, seed: int = 0):
        super().__init__()
        stiefel = geoopt.EuclideanStiefel()  # geoopt.Stiefel() is the canonical metric: rfedray refuses it
        start = torch.linalg.qr(torch.randn(channels, d, generator=torch.Generator().manual_seed(seed)))[0]
        self.bimap = geoopt.ManifoldParameter(start, manifold=stiefel)
        self.head = nn.Parameter(torch.zeros(num_classes, d * (d + 1) // 2 + 1))  # [weight | bias]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores of covariances ``x`` of shape ``(N, C, C)``: ``(N, K)``."""
        features = vech(sym_clamped_log(self.bimap.mT @ x @ self.bimap, self.eps))
        return features @ self.head[:, :-1].mT + self.head[:, -1]


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> dict:
    return {"accuracy": (logits.argmax(-1) == y).double().mean()}


def spdnet(info: dict, retraction: str = "polar", d: int = 3, seed: int = 0) -> rfedray.ModuleModel:
    """The model factory: ``model.name: "custom_model:spdnet"``, options ``d`` and ``seed``."""
    net = SPDNet(info["channels"], d, info["num_classes"], seed=seed)
    return rfedray.ModuleModel(net, loss=F.cross_entropy, metrics=accuracy, retraction=retraction)


class CovarianceFiles(rfedray.ClientPartitions):
    """Client ``i``'s covariances and labels in ``folder/client_<i>.pt``; their sizes in ``folder/index.json``.

    ``client_sizes`` reads the index only (public metadata); ``client_data`` opens one client's file,
    in the process that hosts that client.
    """

    def __init__(self, folder: str):
        self.folder = Path(folder)
        index = json.loads((self.folder / "index.json").read_text())
        self.sizes, self.info = index["sizes"], index["info"]

    def client_sizes(self) -> list[int]:
        return list(self.sizes)

    def client_data(self, client_id: int) -> rfedray.ClientData:
        records = torch.load(self.folder / f"client_{client_id}.pt")
        return rfedray.ClientData(train=(records["x"], records["y"]))

    def eval_data(self) -> rfedray.EvalData:
        held_out = torch.load(self.folder / "test.pt")
        return rfedray.EvalData((held_out["x"], held_out["y"]))


def covariances(n: int, channels: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` normalised covariances of 64-sample signals in which class 1 has more power on channel 0."""
    y = torch.randint(0, 2, (n,), generator=generator)
    power = torch.ones(n, channels, 1)
    power[y == 1, 0] = 3.0
    signals = power.sqrt() * torch.randn(n, channels, 64, generator=generator)
    cov = signals @ signals.mT / 64
    return cov / cov.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None], y


def write_files(folder: Path, n_clients: int = 4, records: int = 96, channels: int = 6, seed: int = 0) -> Path:
    """Stand-in for the sites' own files: one file per client, a held-out file, and the index."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for i in range(n_clients):
        x, y = covariances(records, channels, generator)
        torch.save({"x": x, "y": y}, folder / f"client_{i}.pt")
    x, y = covariances(200, channels, generator)
    torch.save({"x": x, "y": y}, folder / "test.pt")
    info = {"channels": channels, "num_classes": 2, "record_shape": [channels, channels]}
    (folder / "index.json").write_text(json.dumps({"sizes": [records] * n_clients, "info": info}))
    return folder


SETTINGS = {
    "run": {"name": "custom-spdnet", "test_set": "server"},  # the server holds the test file (eval_data)
    "federation": {"n_clients": 4, "clients_per_round": 2, "local_steps": 4, "batch_size": 32},
    "privacy": {"epsilon": 8.0, "delta": 1e-5, "clip": 1.0},
    "optim": {"bimap": {"name": "rsgd", "lr": 0.1}, "head": {"name": "sgd", "lr": 0.5}},
}


def main(argv: list[str] | None = None) -> rfedray.RunResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("local", "ray"), default="local")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    folder = write_files(Path("runs") / "covariance-files")

    dataset = CovarianceFiles(str(folder))
    model = spdnet(dataset.info, d=3)
    result = rfedray.run(SETTINGS, f"run.rounds={args.rounds}", model=model, dataset=dataset, engine=args.engine)
    net = result.load_into(model.module)                # the trained SPDNet
    print(result.run_dir)                               # runs/custom-spdnet-<date>-<id>/
    print(result.summary["epsilon_spent"])              # at most 8.0, the configured target
    print(result.summary["final_metrics"]["accuracy"])  # on the held-out file
    print(torch.dist(net.bimap.mT @ net.bimap, torch.eye(3)).item())  # W stayed on the Stiefel manifold: ~0
    return result


if __name__ == "__main__":
    main()
