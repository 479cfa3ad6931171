#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a CUDA GPU, bounded to 5 minutes: torch and the driver
# (python -m rfedray.cuda stops here with both versions when torch cannot use the GPU), the tests
# marked gpu (tests/test_gpu.py: client actors sharing the GPU, the private step on CUDA against the
# CPU, 16 clients packed on one GPU; tests/test_noise_source.py: the noise drawn on CUDA equals the
# CPU's), then the GPU benchmark (benchmarks/gpu_suite.py, with its Ray
# packing section). Needs the CUDA build of the pinned torch, which `bash scripts/setup.sh --test`
# installs from PyPI on Linux x86_64 (constraints-cuda.txt).
#   bash scripts/gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m rfedray.cuda
timeout 150 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/
timeout 140 "$PY" benchmarks/gpu_suite.py --repeats 10 --rounds 4 --ray
