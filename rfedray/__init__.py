"""rfedray: record-level differentially private federated learning on Riemannian manifolds.

The library is engine-free: a whole federation runs in one process (``rfedray.federated``);
the ``actors`` package distributes the same client and server logic over Ray.
"""

__version__ = "0.1.0"
