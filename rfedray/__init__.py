"""rfedray: record-level differentially private federated learning on Riemannian manifolds.

The library is engine-free: a whole federation runs in one process (``rfedray.federated``);
the ``actors`` package distributes the same client and server logic over Ray.

The Python API (imported on first use, so that ``import rfedray`` stays light)::

    rfedray.run(config, *overrides, model=None, dataset=None, engine=None) -> rfedray.RunResult
    rfedray.load(config, *overrides) -> rfedray.config.Config
    rfedray.ModuleModel(module, loss, metrics=None, manifolds=None)   # your torch.nn.Module
    rfedray.ClientPartitions                                          # base class of your data
    rfedray.ClientData, rfedray.EvalData                              # what your data returns
"""

from importlib import import_module

__version__ = "0.1.0"

_API = {
    "run": "rfedray.api",
    "load": "rfedray.api",
    "RunResult": "rfedray.api",
    "ModuleModel": "rfedray.models.module",
    "UnsupportedManifold": "rfedray.models.module",
    "ClientPartitions": "rfedray.task",
    "ClientData": "rfedray.task",
    "EvalData": "rfedray.task",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'rfedray' has no attribute {name!r}")
