"""How many threads torch and BLAS get in a process that trains clients.

A local step works on minibatches of ``B`` records. When a minibatch holds fewer than
:data:`PARALLEL_MIN_ELEMENTS` numbers (``B`` times the numbers of one record), every kernel of the
step is small (federated PCA at the paper's shapes: 500 x 40; SPDNet: 64 x 22 x 22): a parallel
region costs more than it saves, and on a busy machine the threads of each region wait for one that
lost its core. Such a process runs one thread, and its clients are what runs in parallel (client
actors, one per CPU). Larger minibatches (EEGNet: 64 x 22 x 513) use the CPUs the process has:
all of the machine's for the local engine, ``ray.num_cpus_per_actor`` for a client actor.
``run.threads`` overrides the choice.

Measured on the development machine (2 cores, busy): ``rfedray run --engine local`` at the Table 4
shapes, 20 rounds, took 31.9 s with torch's default of 2 threads and 6.4 s with one
(``benchmarks/bench_threads.py`` measures it side by side).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import threadpoolctl
import torch

PARALLEL_MIN_ELEMENTS = 1 << 18
"""Numbers per minibatch from which a step's kernels are large enough to run in parallel."""


def available_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def choose_threads(batch_size: int, record_shape: tuple[int, ...], cpus: int, override: Optional[int] = None) -> int:
    """The thread count of a process training minibatches of ``batch_size`` records of ``record_shape``.

    Parameters
    ----------
    batch_size : int
        ``B``.
    record_shape : tuple of int
        The shape of one record (``(d,)``, ``(C, C)``, ``(C, T)``).
    cpus : int
        The CPUs the process has (at least 1).
    override : int or None
        ``run.threads``: used as given when not None.

    Returns
    -------
    int
        1 below :data:`PARALLEL_MIN_ELEMENTS` numbers per minibatch, else ``cpus``.
    """
    if override is not None:
        return override
    if batch_size * math.prod(record_shape) < PARALLEL_MIN_ELEMENTS:
        return 1
    return max(1, cpus)


def use_threads(threads: int) -> int:
    """Give torch (intra-op) and the BLAS libraries loaded in this process ``threads`` threads."""
    torch.set_num_threads(threads)
    threadpoolctl.threadpool_limits(limits=threads, user_api="blas")
    return threads
