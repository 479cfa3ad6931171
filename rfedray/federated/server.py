"""The server of DP-RFedProj: fixed-size cohorts, defended aggregation, evaluation.

The server is honest-but-curious: it sees theta_t, the cohort S_t and the submissions, all of
which are covered by the record-level guarantee. It never sees records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from rfedray import aggregation
from rfedray.geometry import ProductManifold
from rfedray.task import Params

FAR_FACTOR = 1e3


@dataclass
class Rejection:
    """A submission the server refused, and why (logged and counted, never aggregated)."""

    client_id: int
    reason: str


def cohort(seed: int, round_index: int, n_clients: int, k: int) -> list[int]:
    """S_t: k of n clients drawn uniformly without replacement, a function of (seed, t).

    The cohort is public (the server announces it), so a seeded draw leaks nothing.
    """
    rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(0xC0, round_index)))
    return sorted(int(i) for i in rng.choice(n_clients, size=k, replace=False))


class Server:
    """Combines submissions with the chosen scheme, group by group.

    Parameters
    ----------
    product : ProductManifold
    scheme : rfedray.aggregation.AggregationScheme
    weights : sequence of float or None
        Per-client aggregation weights (e.g. data sizes); ``None`` for the uniform mean.
    """

    def __init__(self, product: ProductManifold, scheme: aggregation.AggregationScheme, weights: Optional[Sequence[float]] = None):
        self.product = product
        self.scheme = scheme
        self.weights = None if weights is None else [float(w) for w in weights]

    def check_submission(self, theta: Params, submission: Params) -> Optional[str]:
        """Why a submission is unusable (not finite, wrong groups or shapes, absurdly far), or None."""
        if not isinstance(submission, Mapping) or set(submission) != set(theta):
            return f"expected parameter groups {sorted(theta)}"
        for name, value in submission.items():
            if not isinstance(value, torch.Tensor) or value.shape != theta[name].shape:
                return f"group {name!r}: expected a tensor of shape {tuple(theta[name].shape)}"
            if not value.is_floating_point():
                return f"group {name!r}: dtype {value.dtype} is not a real floating-point type"
            if not bool(torch.isfinite(value).all()):
                return f"group {name!r}: not finite"
            scale = FAR_FACTOR * (1.0 + float(torch.linalg.vector_norm(theta[name])))
            if float(torch.linalg.vector_norm(value)) > scale:
                return f"group {name!r}: norm beyond {scale:.3g}, far outside the manifold's neighbourhood"
        return None

    def aggregate(self, theta: Params, submissions: Mapping[int, Params]) -> tuple[Params, list[Rejection]]:
        """theta_{t+1} from the valid submissions; theta_t unchanged if none is valid."""
        rejected = []
        valid: dict[int, Params] = {}
        for cid, sub in submissions.items():
            reason = self.check_submission(theta, sub)
            if reason is None:
                valid[cid] = {name: sub[name].to(theta[name].dtype) for name in theta}
            else:
                rejected.append(Rejection(cid, reason))
        if not valid:
            return theta, rejected
        ids = sorted(valid)
        weights = None if self.weights is None else [self.weights[i] for i in ids]
        new = aggregation.combine(self.scheme, self.product, theta, [valid[i] for i in ids], weights)
        if not all(bool(torch.isfinite(v).all()) for v in new.values()):
            return theta, rejected + [Rejection(-1, "aggregate not finite; round discarded")]
        return new, rejected
