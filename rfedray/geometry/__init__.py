"""Embedded manifolds with the induced Frobenius metric, and their products.

Every manifold offers the nearest-point projection ``project`` (Pi), the orthogonal tangent
projection ``proj_tangent`` (P_x), a retraction with its inverse, ``exp``/``log`` and random
points; :class:`ProductManifold` applies them group by group to ``dict[str, Tensor]`` parameters.
"""

from rfedray.geometry.base import Manifold, NotConvergedError
from rfedray.geometry.euclidean import Euclidean
from rfedray.geometry.grassmann import Grassmann
from rfedray.geometry.product import ProductManifold
from rfedray.geometry.sphere import Sphere
from rfedray.geometry.stiefel import (
    STIEFEL_RETRACTIONS,
    PolarRetraction,
    QRRetraction,
    Stiefel,
    StiefelRetraction,
)

__all__ = [
    "Manifold",
    "NotConvergedError",
    "Euclidean",
    "Sphere",
    "Stiefel",
    "StiefelRetraction",
    "PolarRetraction",
    "QRRetraction",
    "STIEFEL_RETRACTIONS",
    "Grassmann",
    "ProductManifold",
]
