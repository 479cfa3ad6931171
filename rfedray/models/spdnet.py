"""SPDNet (Huang and Van Gool, 2017) on EEG covariances, for private federated training.

Architecture, for a covariance ``X_0`` of shape ``(C, C)``::

    X_k = W_k^T X_{k-1} W_k,  W_k in St(d_{k-1}, d_k)      BiMap, k = 1..L (d_0 = C, d_L = d)
    X_k <- max(X_k, eps_R)                                 ReEig between BiMaps (k < L)
    S   = log(max(X_L, eps_R))                             ReEig and LogEig fused, one eigh
    v   = Vech(S)                                          D = d (d + 1) / 2 entries
    logits = A [v; 1]                                      linear head, A of shape (K, D + 1)

Every spectral step goes through :mod:`rfedray.spectral`, whose Daleckii-Krein backward is finite
when ReEig clamps several eigenvalues to the same floor (plain ``eigh`` autograd gives NaN there,
and one NaN per-sample gradient ruins a private step). The paper uses one BiMap (``depth = 1``);
deeper nets take intermediate sizes spaced evenly between ``C`` and ``d``.

Vech takes the upper triangle row by row and scales the off-diagonal entries by ``sqrt(2)``, so
``||Vech(S)||_2 = ||S||_F``: the head sees the log-Euclidean (Frobenius) geometry of ``S``.

Parameter groups (``groups``): ``"bimap"`` is ``W_1`` on ``Stiefel(C, d_1)`` and deeper BiMaps are
``"bimap2"``, ``"bimap3"``, ... on their Stiefel manifolds; ``"head"`` is the Euclidean matrix
``A = [weight | bias]`` of shape ``(K, D + 1)`` (one tensor, since a group is one tensor). Parameter
counts are ambient sizes, ``C d + K (D + 1)`` for one BiMap, which is how Table 13 counts them:
900 for BNCI2014_001 (22 -> 16, 4 classes), 2,677 for Weibo2014 (60 -> 20, 7), 1,298 for Cho2017
(64 -> 16, 2). (The intrinsic dimension of St(C, d) is ``C d - d (d + 1) / 2``, smaller.)

Inputs should be normalised covariances (:mod:`rfedray.data.eeg` divides each by its mean
eigenvalue); raw EEG covariances (~1e-10 V^2) would be clamped whole by eps_R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rfedray.options import DTYPES, POSITIVE_INT, Checked, OptionsError, Rule, ranged
from rfedray.geometry import Euclidean, Stiefel
from rfedray.geometry.stiefel import PolarRetraction, StiefelRetraction
from rfedray.spectral import sym_clamp, sym_clamped_log
from rfedray.task import EvalData, Params

HEAD = "head"

PAPER_SETTINGS = {"BNCI2014_001": (16, 8e-5), "Weibo2014": (20, 2e-5), "Cho2017": (16, 6e-5)}
"""Table 5: BiMap output size ``d`` and ReEig floor ``eps_R`` per dataset."""
DEFAULT_SETTINGS = (16, 1e-4)


def bimap_group(k: int) -> str:
    """Name of the group of the k-th BiMap weight (k = 1, 2, ...): ``bimap``, ``bimap2``, ..."""
    return "bimap" if k == 1 else f"bimap{k}"


def bimap_dims(channels: int, d: int, depth: int) -> list[int]:
    """Sizes ``[d_0 = C, d_1, ..., d_L = d]``, evenly spaced and non-increasing."""
    return [round(channels + (d - channels) * k / depth) for k in range(depth + 1)]


def vech(s: Tensor) -> Tensor:
    """Upper triangle of symmetric ``s`` (shape ``(..., n, n)``), off-diagonals times ``sqrt(2)``.

    Returns
    -------
    Tensor, shape (..., n (n + 1) / 2)
        Row by row; ``||vech(s)||_2 = ||s||_F``.
    """
    n = s.shape[-1]
    rows, cols = torch.triu_indices(n, n, device=s.device)
    weight = torch.where(rows == cols, 1.0, 2.0 ** 0.5).to(s.dtype)
    return s[..., rows, cols] * weight


def bimap(x: Tensor, w: Tensor) -> Tensor:
    """``W^T X W``: ``x`` of shape ``(..., n, n)``, ``w`` of shape ``(n, p)``; result ``(..., p, p)``."""
    return w.transpose(-1, -2) @ x @ w


class SPDNet:
    """SPDNet as a :class:`rfedray.task.FederatedModel`.

    Parameters
    ----------
    channels : int
        ``C``, the size of the input covariances.
    num_classes : int
        ``K``.
    d : int
        Output size of the last BiMap, ``1 <= d <= C``.
    eps_reeig : float
        ReEig floor ``eps_R > 0``.
    depth : int
        Number of BiMap layers ``L >= 1``.
    dtype : torch.dtype
        Of the parameters; inputs are cast to it.
    retraction : StiefelRetraction or its class
        Retraction of the Stiefel groups.
    init_filters : Tensor or None
        Where the first BiMap starts: ``None`` draws ``W_1`` Haar-uniformly on ``St(C, d_1)``; a
        ``(C, d_1)`` matrix of orthonormal columns starts it there (spatial filters: a channel
        selection ``[e_c1 ... e_cd]``, or e.g. small Laplacians).
    scale_free : bool
        Divide ``X_L`` by its mean eigenvalue ``tr(X_L) / d`` before the LogEig (a per-record map): the
        features are then log-powers relative to the record's own mean power, and a common scale of
        all records (the tangent features' offset from the identity) is gone.
    """

    gradient_rule = None
    """Per-record gradients by ``vmap(grad)`` (no closed form: see :class:`~rfedray.privacy.mechanism.PerSampleRule`)."""

    def __init__(
        self,
        channels: int,
        num_classes: int,
        d: int,
        eps_reeig: float,
        depth: int = 1,
        dtype: torch.dtype = torch.float32,
        retraction: StiefelRetraction | type[StiefelRetraction] = PolarRetraction,
        init_filters: Optional[Tensor] = None,
        scale_free: bool = False,
    ):
        if not 1 <= d <= channels:
            raise ValueError(f"d={d!r}: must be between 1 and channels ({channels})")
        if depth < 1:
            raise ValueError(f"depth={depth!r}: must be an integer >= 1")
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r}: must be an integer >= 2")
        if not 0.0 < eps_reeig < float("inf"):
            raise ValueError(f"eps_reeig={eps_reeig!r}: must be a finite number > 0")
        self.channels, self.num_classes, self.d, self.depth = channels, num_classes, d, depth
        self.eps_reeig = float(eps_reeig)
        self.dtype = dtype
        self.dims = bimap_dims(channels, d, depth)
        if init_filters is not None:
            init_filters = torch.as_tensor(init_filters, dtype=torch.float64)
            eye = torch.eye(self.dims[1], dtype=torch.float64)
            if init_filters.shape != (channels, self.dims[1]) or not torch.allclose(init_filters.T @ init_filters, eye, atol=1e-9):
                raise ValueError(f"init_filters: must be a ({channels}, {self.dims[1]}) matrix with orthonormal columns")
        self.init_filters = init_filters
        self.scale_free = bool(scale_free)
        self.features = d * (d + 1) // 2
        self.bimaps = [bimap_group(k) for k in range(1, depth + 1)]
        self.groups = {
            **{name: Stiefel(n, p, retraction) for name, n, p in zip(self.bimaps, self.dims[:-1], self.dims[1:])},
            HEAD: Euclidean(num_classes, self.features + 1),
        }

    @property
    def num_parameters(self) -> int:
        """Ambient parameter count (Table 13's count)."""
        return sum(m.ambient_dim for m in self.groups.values())

    def init_params(self, generator: torch.Generator) -> Params:
        """Haar-random BiMap weights (the first one ``init_filters`` if set); head weights
        ``N(0, 1/D)``, bias 0. The generator draws the same numbers either way."""
        params = {name: self.groups[name].random_point(generator=generator, dtype=torch.float64) for name in self.bimaps}
        if self.init_filters is not None:
            params[self.bimaps[0]] = self.init_filters.clone()
        weight = torch.randn(self.num_classes, self.features, generator=generator, dtype=torch.float64)
        bias = torch.zeros(self.num_classes, 1, dtype=torch.float64)
        params[HEAD] = torch.cat([weight / self.features ** 0.5, bias], dim=1)
        return {name: value.to(self.dtype) for name, value in params.items()}

    def tangent_features(self, params: Params, x: Tensor) -> Tensor:
        """``Vech(log(max(X_L, eps_R)))`` of covariances ``x`` of shape ``(..., C, C)``: ``(..., D)``
        (``X_L / (tr(X_L) / d)`` in place of ``X_L`` when ``scale_free``)."""
        x = x.to(self.dtype)
        x = bimap(x, params[self.bimaps[0]])
        for name in self.bimaps[1:]:
            x = bimap(sym_clamp(x, self.eps_reeig), params[name])
        if self.scale_free:
            x = x / (x.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None])
        return vech(sym_clamped_log(x, self.eps_reeig))

    def logits(self, params: Params, x: Tensor) -> Tensor:
        """Class scores of covariances ``x`` of shape ``(..., C, C)``: ``(..., K)``."""
        head = params[HEAD]
        return self.tangent_features(params, x) @ head[:, :-1].transpose(0, 1) + head[:, -1]

    def per_sample_loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """Cross-entropy of one record: ``x`` of shape ``(C, C)``, integer label ``y`` of shape ``()``."""
        return F.cross_entropy(self.logits(params, x), y)

    def evaluate(self, params: Params, data: EvalData, chunk: int = 4096) -> dict[str, float]:
        """Accuracy and mean cross-entropy on ``data.tensors = (x, y)``, ``x`` of shape ``(n, C, C)``."""
        return classification_metrics(self.logits, params, data, chunk)


def classification_metrics(logits_fn, params: Params, data: EvalData, chunk: int) -> dict[str, float]:
    """``accuracy`` and mean cross-entropy ``loss`` of ``logits_fn(params, x)`` over ``(x, y)``, in chunks."""
    x, y = data.tensors[:2]
    with torch.no_grad():
        logits = torch.cat([logits_fn(params, part) for part in torch.split(x, chunk)])
        loss = F.cross_entropy(logits.double(), y, reduction="mean")
        accuracy = (logits.argmax(dim=-1) == y).double().mean()
    return {"accuracy": float(accuracy), "loss": float(loss)}


@dataclass
class Options(Checked):
    """Schema of ``model.options`` for ``model.name: spdnet``.

    Attributes
    ----------
    d : int or None
        Output size of the last BiMap; ``None`` takes Table 5's value for the dataset (16 when the
        dataset is not in Table 5).
    eps_reeig : float or None
        ReEig floor; ``None`` takes Table 5's value (1e-4 when the dataset is not in Table 5).
    depth : int
        Number of BiMap layers (the paper: 1).
    init_filters : list of {channel: weight} or None
        Start the first BiMap at these spatial filters instead of a Haar-random point: filter ``j``
        is column ``j`` of ``W_1``, the named channels (of ``data.options.channels``) with their
        weights, scaled to unit norm; distinct filters must be orthogonal (e.g. disjoint channels),
        and ``d`` is their number. A public prior, not a statistic of the records: e.g. the small
        Laplacians at C3 and C4, ``{C3: 1, FC3: -0.25, CP3: -0.25, C1: -0.25, C5: -0.25}`` and its
        mirror, the spatial filter of the BCI2000 mu-rhythm studies (McFarland et al. 1997), or a
        channel selection ``{C3: 1}``.
    scale_free : bool
        Divide ``X_L`` by its mean eigenvalue before the LogEig (:class:`SPDNet`): per record, the
        features become log-powers relative to the record's own mean power.
    """

    d: Optional[int] = ranged(None, Rule(lambda v: v >= 1, "must be null (Table 5) or an integer >= 1"))
    eps_reeig: Optional[float] = ranged(None, Rule(lambda v: 0.0 < v < float("inf"), "must be null (Table 5) or a finite number > 0"))
    depth: int = ranged(1, POSITIVE_INT)
    init_filters: Optional[List[Dict[str, float]]] = None
    scale_free: bool = False

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.init_filters is not None:
            filters = self.init_filters
            if not filters or not all(f and all(math.isfinite(w) for w in f.values()) and any(w != 0 for w in f.values())
                                      for f in filters):
                raise OptionsError(f"{prefix}.init_filters", filters,
                                   "must be null (Haar-random) or a non-empty list of {channel: weight} with finite, not all zero weights")
            if self.depth != 1:
                raise OptionsError(f"{prefix}.init_filters", filters, f"needs model.options.depth=1 (got {self.depth})")
            if self.d is not None and self.d != len(filters):
                raise OptionsError(f"{prefix}.d", self.d, f"must be null or the number of model.options.init_filters ({len(filters)})")


def filter_matrix(filters: Sequence[dict], names: Sequence[str]) -> Tensor:
    """The ``(C, d)`` matrix of ``filters`` (each ``{channel: weight}``) over the channels ``names``,
    columns scaled to unit norm; raises :class:`OptionsError` unless they are orthogonal."""
    names = list(names)
    missing = sorted({c for f in filters for c in f} - set(names))
    if missing:
        raise OptionsError("model.options.init_filters", filters, f"{missing} not among data.options.channels {names}")
    w = torch.zeros(len(names), len(filters), dtype=torch.float64)
    for j, f in enumerate(filters):
        for channel, weight in f.items():
            w[names.index(channel), j] = float(weight)
    w = w / w.norm(dim=0)
    if not torch.allclose(w.T @ w, torch.eye(len(filters), dtype=torch.float64), atol=1e-9):
        raise OptionsError("model.options.init_filters", filters, "distinct filters must be orthogonal (e.g. on disjoint channels)")
    return w


def build(options: Options, info: dict, retraction: StiefelRetraction | type[StiefelRetraction] = PolarRetraction) -> SPDNet:
    """SPDNet for a dataset described by ``info`` (``channels``, ``num_classes``, ``dataset``, ``dtype``)."""
    if info.get("representation", "covariance") != "covariance":
        raise OptionsError("data.options.representation", info["representation"], "SPDNet needs covariance inputs")
    paper_d, paper_eps = PAPER_SETTINGS.get(info.get("dataset", ""), DEFAULT_SETTINGS)
    filters = None
    if options.init_filters is not None:
        OptionsError.check(info.get("channel_names"), "model.options.init_filters", options.init_filters,
                           "needs the channels named by the data (set data.options.channels)")
        filters = filter_matrix(options.init_filters, info["channel_names"])
    d = filters.shape[1] if filters is not None else options.d if options.d is not None else paper_d
    if d > info["channels"]:
        raise OptionsError("model.options.d", d, f"must be <= the number of channels ({info['channels']})")
    eps = options.eps_reeig if options.eps_reeig is not None else paper_eps
    return SPDNet(info["channels"], info["num_classes"], d, eps, options.depth, DTYPES[info.get("dtype", "float32")], retraction,
                  init_filters=filters, scale_free=options.scale_free)
