"""Checks of records that the data sources share: finite values, symmetric positive definite matrices.

Each check returns the first problem it finds, with the record's index, or ``None``; the data
source turns it into one error that also says where the record comes from (file, client,
subject) and what to do. No message holds a value of a record (an entry, an eigenvalue, a label):
error messages and logs are something the server sees, and they are not privatised.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np


def first_nonfinite(x: np.ndarray) -> Optional[str]:
    """The first record of ``x`` (shape ``(n, ...)``) holding a NaN or an infinity, described.

    Parameters
    ----------
    x : ndarray
        Records along the first axis, of a real numeric dtype.

    Returns
    -------
    str or None
        E.g. ``"record 17 is not finite (nan)"``; None when every value is finite.
    """
    flat = x.reshape(x.shape[0], -1)
    bad = np.flatnonzero(~np.isfinite(flat).all(axis=1))
    if bad.size == 0:
        return None
    values = flat[bad[0]]
    kind = "nan" if np.isnan(values).any() else "inf"
    return f"record {int(bad[0])} is not finite ({kind})"


def spd_problem(x: np.ndarray) -> Optional[str]:
    """The first matrix of ``x`` that is not symmetric positive definite, described.

    A matrix is taken as symmetric when ``|X - X^T|`` stays within 100 machine epsilons of its
    largest entry, and as positive definite when its smallest eigenvalue exceeds ``C`` machine
    epsilons (of ``x``'s dtype) times its largest one; below that it is numerically singular.

    Parameters
    ----------
    x : ndarray, shape (n, C, C)
        Finite matrices (check :func:`first_nonfinite` first).

    Returns
    -------
    str or None
        E.g. ``"record 3 is singular or not positive definite"``: the record's index and the
        problem, never a value of the record (an error message is something the server sees).
    """
    n, rows, cols = x.shape
    if rows != cols:
        return f"records have shape ({rows}, {cols}); covariances are square (C, C) matrices"
    eps = np.finfo(x.dtype).eps if np.issubdtype(x.dtype, np.floating) else np.finfo(np.float64).eps
    x64 = x.astype(np.float64)
    scale = np.abs(x64).reshape(n, -1).max(axis=1)
    asymmetry = np.abs(x64 - np.swapaxes(x64, -1, -2)).reshape(n, -1).max(axis=1)
    bad = np.flatnonzero(asymmetry > 100 * eps * scale)
    if bad.size:
        i = int(bad[0])
        return f"record {i} is not symmetric"
    eigenvalues = np.linalg.eigvalsh(0.5 * (x64 + np.swapaxes(x64, -1, -2)))
    smallest, largest = eigenvalues[:, 0], eigenvalues[:, -1]
    bad = np.flatnonzero(~(smallest > rows * eps * np.maximum(largest, 0.0)) | ~(largest > 0))
    if bad.size:
        i = int(bad[0])
        return f"record {i} is singular or not positive definite"
    return None


def available_memory() -> int:
    """Bytes of memory this machine can give a new allocation now (``MemAvailable`` of /proc/meminfo).

    Falls back to the free pages where ``/proc/meminfo`` is not there.
    """
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
