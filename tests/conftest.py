"""Shared test set-up: one torch thread per process.

On 2-core machines shared with Ray workers and other processes, two torch threads per process
made small linear algebra 5-50x slower; every test module runs with one thread.
"""

import torch

torch.set_num_threads(1)
