"""Your own ``torch.nn.Module`` as a federated model: parameter groups read from the module, per-record
gradients computed functionally.

:class:`ModuleModel` turns a module and a loss into a :class:`~rfedray.task.FederatedModel`::

    net = MyNet()                                  # geoopt ManifoldParameters and plain parameters
    model = ModuleModel(net, loss=F.cross_entropy, metrics=accuracy)

Parameter groups. Every trainable parameter of the module is one group, named as in
``module.named_parameters()``, on the manifold that the parameter declares:

=====================================================  ===========================================
the parameter                                           its rfedray manifold
=====================================================  ===========================================
a plain ``nn.Parameter`` (any shape)                    :class:`~rfedray.geometry.Euclidean`
``geoopt.ManifoldParameter`` on ``geoopt.Euclidean``    :class:`~rfedray.geometry.Euclidean`
``geoopt.ManifoldParameter`` on ``EuclideanStiefel``    :class:`~rfedray.geometry.Stiefel` ``(n, p)``
``geoopt.ManifoldParameter`` on ``geoopt.Sphere``       :class:`~rfedray.geometry.Sphere` ``(n,)``
named in ``manifolds={name: manifold}``                 that rfedray manifold (e.g. ``Grassmann``)
=====================================================  ===========================================

Any other geoopt manifold is refused (:class:`UnsupportedManifold`), in particular geoopt's default
``Stiefel()``, which is ``CanonicalStiefel``: the private step clips every record's gradient in the
Frobenius norm of the ambient space after the orthogonal projection onto the tangent space, and
adds ambient noise projected likewise. That bounds a record's influence by ``2C/B`` in the metric
the ambient space induces on the manifold (the embedded metric). The canonical metric
``<U, V>_X = tr(U^T (I - X X^T / 2) V)`` is another metric, and geoopt's ``proju`` for it is not
the orthogonal projection, so a gradient clipped there is not clipped in the geometry the guarantee
is stated in. ``geoopt.EuclideanStiefel()`` is the same set of matrices with the embedded metric.

Per-record gradients. The loss of one record ``(x, *targets)`` is computed by running the module
on a batch of one record through :func:`torch.func.functional_call`, with the parameters of the
step in place of the module's own::

    f(theta; x, *targets) = loss(module_theta(x[None]), *(t[None] for t in targets))

and the private step takes ``torch.func.vmap(torch.func.grad(f))`` over the minibatch (one kernel
per layer for all records, no Python loop over records). ``loss`` is the usual batch loss (e.g.
``F.cross_entropy``, mean over the batch), so the same function also gives the evaluation loss on a
whole batch. The module runs in evaluation mode: a layer that mixes records (batch normalisation in
training mode) would make one record's gradient depend on the others, and dropout would draw from
torch's global generator, not from the client's.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call

from rfedray.errors import RfedrayError
from rfedray.geometry import STIEFEL_RETRACTIONS, Euclidean, Manifold, Sphere, Stiefel, StiefelRetraction
from rfedray.task import EvalData, Params

SUPPORTED_GEOOPT = "geoopt.Euclidean, geoopt.EuclideanStiefel, geoopt.Sphere"

ON_MANIFOLD_TOL = 1e-4
"""Largest distance ``||x - Pi(x)||_F``, relative to ``sqrt(numel)``, of an initial value to its manifold."""


class UnsupportedManifold(RfedrayError, TypeError):
    """A parameter whose manifold the private step cannot clip in the ambient geometry."""


def _geoopt_manifold(name: str, manifold: Any, shape: tuple[int, ...], retraction: StiefelRetraction) -> Manifold:
    """The rfedray manifold of a ``geoopt.ManifoldParameter`` of ``shape``.

    Raises
    ------
    UnsupportedManifold
        For geoopt's canonical Stiefel manifold and every manifold outside :data:`SUPPORTED_GEOOPT`,
        and for shapes that are products of several points (``(k, n)`` spheres, ``(k, n, p)`` frames).
    """
    geoopt = importlib.import_module("geoopt")
    where = f"parameter {name!r} of shape {shape}"
    if isinstance(manifold, geoopt.CanonicalStiefel):
        raise UnsupportedManifold(
            f"{where} is on geoopt's CanonicalStiefel (what geoopt.Stiefel() gives by default): its canonical "
            "metric is not the one the ambient Frobenius norm induces, and rfedray clips every record's "
            "gradient in the ambient geometry (Frobenius norm after the orthogonal tangent projection), which "
            "bounds the sensitivity only for that embedded metric; use geoopt.EuclideanStiefel() (the same "
            "matrices with the embedded metric) or rfedray.geometry.Stiefel"
        )
    if isinstance(manifold, geoopt.EuclideanStiefel):
        if len(shape) != 2:
            raise UnsupportedManifold(f"{where} is on geoopt.EuclideanStiefel: rfedray needs one (n, p) frame per "
                                      "parameter; split a batch of frames into several parameters")
        return Stiefel(shape[0], shape[1], retraction)
    if isinstance(manifold, geoopt.Sphere):
        if manifold.projector is not None:
            raise UnsupportedManifold(f"{where} is on a geoopt.Sphere intersected with a subspace, which rfedray "
                                      "does not model; use the whole sphere geoopt.Sphere()")
        if len(shape) != 1:
            raise UnsupportedManifold(f"{where} is on geoopt.Sphere: rfedray needs one (n,) vector per parameter; "
                                      "split a batch of vectors into several parameters")
        return Sphere(shape[0])
    if type(manifold) is geoopt.Euclidean:
        return Euclidean(*shape)
    raise UnsupportedManifold(
        f"{where} is on {type(manifold).__name__}, which rfedray cannot clip in the ambient geometry; supported: "
        f"{SUPPORTED_GEOOPT}, plain parameters (Euclidean) and rfedray's own manifolds (ModuleModel(manifolds=...))"
    )


def module_groups(
    module: nn.Module, manifolds: Mapping[str, Manifold], retraction: StiefelRetraction
) -> dict[str, Manifold]:
    """The parameter groups of ``module``: one per trainable parameter, in registration order.

    Parameters
    ----------
    module : nn.Module
    manifolds : mapping of str to Manifold
        rfedray manifolds for some parameters, by name (they win over what the parameter declares).
    retraction : StiefelRetraction
        Of the Stiefel groups read from geoopt parameters.

    Raises
    ------
    UnsupportedManifold
        See :func:`_geoopt_manifold`; also for a 0-dimensional parameter, a name in ``manifolds``
        that is not a trainable parameter, and a manifold whose shape is not the parameter's.
    """
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    unknown = sorted(set(manifolds) - set(params))
    if unknown:
        raise UnsupportedManifold(f"manifolds names {unknown}, which are not trainable parameters of the module "
                                  f"(it has {sorted(params)})")
    if not params:
        raise UnsupportedManifold("the module has no trainable parameters")
    groups: dict[str, Manifold] = {}
    for name, p in params.items():
        shape = tuple(p.shape)
        if len(shape) == 0:
            raise UnsupportedManifold(f"parameter {name!r} is a scalar; give it shape (1,)")
        if name in manifolds:
            manifold = manifolds[name]
            if not isinstance(manifold, Manifold) or tuple(manifold.shape) != shape:
                raise UnsupportedManifold(f"manifolds[{name!r}]={manifold!r}: must be an rfedray.geometry manifold "
                                          f"of shape {shape}, the parameter's")
        elif getattr(p, "manifold", None) is not None:
            manifold = _geoopt_manifold(name, p.manifold, shape, retraction)
        else:
            manifold = Euclidean(*shape)
        groups[name] = manifold
    return groups


class ModuleModel:
    """A ``torch.nn.Module`` and a loss as a :class:`rfedray.task.FederatedModel`.

    Parameters
    ----------
    module : nn.Module
        Its trainable parameters are the model (see the module docstring for their manifolds);
        their current values are the starting point of the federation. Buffers and frozen
        parameters are constants.
    loss : callable
        ``loss(output, *targets) -> scalar``, the mean loss of a batch, where ``output =
        module(x)`` for the records ``(x, *targets)`` (each with a leading batch dimension). The
        private step calls it on batches of one record; evaluation on the whole evaluation set.
    metrics : callable, optional
        ``metrics(output, *targets) -> {name: number}``, more evaluation metrics (e.g. accuracy).
    manifolds : mapping of str to rfedray.geometry.Manifold, optional
        rfedray manifolds of parameters by name (e.g. ``{"basis": Grassmann(40, 4)}``).
    retraction : {"polar", "qr"}
        Of the Stiefel groups read from geoopt parameters; it must be the run's
        ``aggregation.retraction``.
    chunk : int
        Records per forward pass in :meth:`evaluate`.

    Raises
    ------
    UnsupportedManifold
        When a parameter's manifold cannot be clipped in the ambient geometry, or an initial value
        is not on its manifold.
    """

    gradient_rule = None
    """Per-record gradients by ``vmap(grad)`` of :meth:`per_sample_loss`."""

    def __init__(
        self,
        module: nn.Module,
        loss: Callable[..., Tensor],
        *,
        metrics: Optional[Callable[..., Mapping[str, Any]]] = None,
        manifolds: Optional[Mapping[str, Manifold]] = None,
        retraction: str = "polar",
        chunk: int = 4096,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={module!r}: must be a torch.nn.Module")
        if retraction not in STIEFEL_RETRACTIONS:
            raise ValueError(f"retraction={retraction!r}: must be one of {', '.join(STIEFEL_RETRACTIONS)}")
        self.module = module.eval()
        self.loss, self.metrics, self.chunk = loss, metrics, int(chunk)
        self.groups = module_groups(module, dict(manifolds or {}), STIEFEL_RETRACTIONS[retraction]())
        self._start = {name: p.detach().clone() for name, p in module.named_parameters() if name in self.groups}
        for name, value in self._start.items():
            self._check_on_manifold(name, value)

    def _check_on_manifold(self, name: str, value: Tensor) -> None:
        manifold = self.groups[name]
        distance = float(torch.linalg.vector_norm(value.double() - manifold.project(value.double())))
        if not distance <= ON_MANIFOLD_TOL * value.numel() ** 0.5:
            raise UnsupportedManifold(
                f"parameter {name!r} starts {distance:.3g} away from its manifold {manifold!r}; initialise it on "
                "the manifold (e.g. geoopt's manifold.random(...) or nn.init.orthogonal_ for a Stiefel frame)"
            )

    def init_params(self, generator: torch.Generator) -> Params:
        """The module's parameters as they were given (``generator`` is not used)."""
        return {name: value.clone() for name, value in self._start.items()}

    def forward(self, params: Params, x: Tensor) -> Tensor:
        """``module(x)`` with ``params`` in place of the module's parameters; ``x`` of shape ``(N, ...)``."""
        return functional_call(self.module, params, (x,))

    def per_sample_loss(self, params: Params, x: Tensor, *targets: Tensor) -> Tensor:
        """The loss of one record ``(x, *targets)`` (no batch dimension): the module on a batch of one."""
        return self.loss(self.forward(params, x.unsqueeze(0)), *(t.unsqueeze(0) for t in targets))

    def evaluate(self, params: Params, data: EvalData) -> dict[str, float]:
        """``loss`` (and ``metrics``) of the model on ``data.tensors = (x, *targets)``; nothing without data."""
        if not data.tensors:
            return {}
        x, *targets = data.tensors
        with torch.no_grad():
            output = torch.cat([self.forward(params, part) for part in torch.split(x, self.chunk)])
            values = {"loss": self.loss(output, *targets)}
            if self.metrics is not None:
                values.update(self.metrics(output, *targets))
        return {name: float(value) for name, value in values.items()}
