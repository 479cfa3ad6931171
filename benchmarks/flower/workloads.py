"""The two workloads of the side-by-side benchmark, as a Flower user writes them (torch and numpy only).

This module runs in Flower's environment (``.venv-flower``), never imports rfedray, and is what
:mod:`benchmarks.side_by_side` compares rfedray against.

* ``fedpca``: record-level DP federated PCA on the Grassmann manifold. The model is a rank-4
  projector ``X`` in Sym(40) (float32); client ``i`` has m = 5000 unit-norm records
  ``z ~ N(0, Sigma_i)``, regenerated from its id inside every fit (a few ms, nothing travels).
  A local step (tau = 10 a round): B = 500 records without replacement, per-record gradients of
  ``-z^T X z`` by ``vmap(grad)``, tangent projection ``P_X(G) = X Gs + Gs X - 2 X Gs X``, clip to
  C = 0.355, mean, ``+ P_X(sigma xi)`` with sigma = 0.0242, ``X <- Pi(X - 0.2 g)`` with ``Pi`` the
  top-4 eigenprojector.
* ``spdnet``: record-level DP SPDNet on EEG covariances (22 channels -> 16, 4 classes: the shapes
  of BNCI2014_001). ``W`` on St(22, 16), a linear head ``A`` of shape (4, 137); logits
  ``A [vech(log(max(W^T x W, eps))); 1]`` with ``eps = 8e-5``. Client ``i``'s records are the
  covariances ``x_<i>``, ``y_<i>`` of an ``.npz`` file (written by the benchmark from rfedray's
  synthetic EEG source, so both engines train on the same records), read inside every fit. A
  local step (tau = 5): B = 64, per-record gradients of the cross-entropy by ``vmap(grad)`` through
  ``torch.linalg.eigh``, Stiefel tangent projection ``G - W sym(W^T G)``, joint clip to C = 1,
  mean, noise sigma = 0.05 projected, ``W <- polar(W - 0.01 g_W)``, ``A <- A - 0.01 g_A``.

The server's maths (:func:`fedpca_average`, :func:`spdnet_average`: ProjAvg, the projection of the
mean of the submitted models) is numpy only, so the Flower driver does not import torch.
"""

from __future__ import annotations

import numpy as np

D, P = 40, 4                                   # fedpca: ambient dimension, rank of the projectors
CHANNELS, DIM, CLASSES, EPS = 22, 16, 4, 8e-5  # spdnet: C, d, K, ReEig floor (Table 5, BNCI2014_001)

FEDPCA = {"records": 5000, "tau": 10, "batch": 500, "lr": 0.2, "clip": 0.355, "sigma": 0.0242}
SPDNET = {"tau": 5, "batch": 64, "lr": 0.01, "clip": 1.0, "sigma": 0.05}


# ---- server side (numpy) ---------------------------------------------------------------------

def grassmann_project(y: np.ndarray) -> np.ndarray:
    """Nearest rank-P projector ``V V^T`` to ``y`` (V: top-P eigenvectors of sym(y)), float32."""
    v = np.linalg.eigh((y + y.T) / 2)[1][:, -P:]
    return (v @ v.T).astype(np.float32)


def polar(y: np.ndarray) -> np.ndarray:
    """The polar factor ``U V^T`` of ``y = U S V^T`` (nearest point of the Stiefel manifold)."""
    u, _, vt = np.linalg.svd(y, full_matrices=False)
    return u @ vt


def fedpca_init() -> list[np.ndarray]:
    return [grassmann_project(np.random.default_rng(0).standard_normal((D, D)))]


def fedpca_average(models: list[list[np.ndarray]]) -> list[np.ndarray]:
    """ProjAvg on the Grassmann manifold: ``Pi(mean X_i)``."""
    return [grassmann_project(np.mean([m[0] for m in models], axis=0, dtype=np.float64))]


def spdnet_init() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    features = DIM * (DIM + 1) // 2
    w = polar(rng.standard_normal((CHANNELS, DIM)))
    head = np.concatenate([rng.standard_normal((CLASSES, features)) / features ** 0.5, np.zeros((CLASSES, 1))], 1)
    return [w.astype(np.float32), head.astype(np.float32)]


def spdnet_average(models: list[list[np.ndarray]]) -> list[np.ndarray]:
    """ProjAvg on St(22, 16) x R^(4 x 137): polar factor of the mean ``W``, mean head."""
    w = polar(np.mean([m[0] for m in models], axis=0, dtype=np.float64))
    head = np.mean([m[1] for m in models], axis=0, dtype=np.float64)
    return [w.astype(np.float32), head.astype(np.float32)]


# ---- client side (torch, imported lazily by the client) --------------------------------------

def fedpca_records(cid: int):
    """m unit-norm records ``z ~ N(0, Sigma_cid)``, Sigma sharing a top-P subspace, shape (m, D)."""
    import torch

    g = torch.Generator().manual_seed(12345)                   # shared basis
    u, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    lam = torch.cat([torch.tensor([4.0, 3.5, 3.0, 2.5]), torch.full((D - P,), 0.05)])
    g = torch.Generator().manual_seed(1000 + int(cid))         # client perturbation
    e = 0.3 * torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5
    sigma = (u * lam) @ u.T + e @ e.T
    z = torch.randn(FEDPCA["records"], D, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(sigma).T
    return (z / z.norm(dim=1, keepdim=True)).to(torch.float32)


def fedpca_fit(model: list[np.ndarray], cid: int, rnd: int) -> list[np.ndarray]:
    """One client's round: regenerate its records, tau private steps, return its iterate."""
    import torch
    from torch.func import grad, vmap

    s = FEDPCA

    def tangent(x, z):
        zs = (z + z.mT) / 2
        xz = x @ zs
        return xz + xz.mT - 2 * xz @ x

    def project(y):
        v = torch.linalg.eigh((y + y.mT) / 2).eigenvectors[..., -P:]
        return v @ v.mT

    per_record = vmap(grad(lambda x, z: -(z @ x @ z)), in_dims=(None, 0))
    data = fedpca_records(cid)
    gen = torch.Generator().manual_seed(7919 * int(cid) + int(rnd))
    x = torch.from_numpy(model[0]).float()
    for _ in range(s["tau"]):
        z = data[torch.randperm(len(data), generator=gen)[:s["batch"]]]
        g = tangent(x, per_record(x, z))                                   # (B, D, D)
        norms = g.flatten(1).norm(dim=1).clamp_min(1e-12)
        g = (g * (s["clip"] / norms).clamp(max=1.0)[:, None, None]).mean(0)
        noise = tangent(x, s["sigma"] * torch.randn(D, D, generator=gen))
        x = project(x - s["lr"] * (g + noise))
    return [x.numpy()]


def spdnet_fit(model: list[np.ndarray], cid: int, rnd: int, path: str) -> tuple[list[np.ndarray], int]:
    """One client's round: read its covariances, tau private steps; the iterate and the record count."""
    import torch
    import torch.nn.functional as F
    from torch.func import grad, vmap

    s = SPDNET
    with np.load(path) as archive:
        x_all = torch.from_numpy(archive[f"x_{cid}"]).float()
        y_all = torch.from_numpy(archive[f"y_{cid}"]).long()
    rows, cols = torch.triu_indices(DIM, DIM)
    vech_weight = torch.where(rows == cols, 1.0, 2.0 ** 0.5)

    def loss(params, x, y):
        w, head = params
        evals, evecs = torch.linalg.eigh(w.T @ x @ w)
        log_s = (evecs * torch.log(torch.clamp(evals, min=EPS))) @ evecs.T
        features = log_s[rows, cols] * vech_weight
        logits = head[:, :-1] @ features + head[:, -1]
        return F.cross_entropy(logits[None], y[None])

    per_record = vmap(grad(loss), in_dims=(None, 0, 0))
    gen = torch.Generator().manual_seed(7919 * int(cid) + int(rnd))
    w, head = (torch.from_numpy(a).float() for a in model)

    def stiefel_tangent(w, g):
        wg = w.mT @ g
        return g - w @ ((wg + wg.mT) / 2)

    for _ in range(s["tau"]):
        idx = torch.randperm(len(x_all), generator=gen)[:s["batch"]]
        gw, ghead = per_record((w, head), x_all[idx], y_all[idx])          # (B, 22, 16), (B, 4, 137)
        gw = stiefel_tangent(w, gw)
        norms = (gw.flatten(1).square().sum(1) + ghead.flatten(1).square().sum(1)).sqrt().clamp_min(1e-12)
        scale = (s["clip"] / norms).clamp(max=1.0)
        gw = (gw * scale[:, None, None]).mean(0) + stiefel_tangent(w, s["sigma"] * torch.randn(w.shape, generator=gen))
        ghead = (ghead * scale[:, None, None]).mean(0) + s["sigma"] * torch.randn(head.shape, generator=gen)
        u, _, vt = torch.linalg.svd(w - s["lr"] * gw, full_matrices=False)
        w, head = u @ vt, head - s["lr"] * ghead
    return [w.numpy(), head.numpy()], len(x_all)
