#!/usr/bin/env bash
# Set up rfedray on a fresh machine: a virtual environment in .venv with the pinned packages of
# constraints.txt (the same file the CI and the cluster nodes use). Idempotent: a second run only
# checks a stamp and returns. With --test it also installs what the integration tests need when it
# is missing: Debian's prometheus (the real scrape tests) and chromium (the live-monitoring test).
# With --flower it also makes Flower's own environment in .venv-flower (the pyproject extra
# "flower", pinned by benchmarks/flower/constraints.txt) for benchmarks/side_by_side.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_TEST=0
WITH_FLOWER=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    --flower) WITH_FLOWER=1 ;;
    *) echo "setup.sh: unknown option $arg (allowed: --test, --flower)" >&2; exit 2 ;;
  esac
done

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.rfedray-stamp
want=$(cat constraints.txt constraints-cuda.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned packages (constraints.txt)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build. On Linux x86_64 the PyPI
  # wheel is a CUDA build whatever the pin; constraints-cuda.txt pins its CUDA wheels.
  .venv/bin/python -m pip install -q -c constraints.txt -c constraints-cuda.txt "torch==$(grep '^torch==' constraints.txt | cut -d= -f3)"
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  echo "$want" > "$stamp"
fi

missing=""
if [ "$WITH_TEST" = 1 ]; then
  command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
  command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
fi
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's$missing for the integration tests"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    if [[ "$missing" == *prometheus* ]]; then
      # The package starts a system service; the tests run their own server.
      (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || pkill -x prometheus || true) >/dev/null 2>&1
    fi
  else
    echo "setup:$missing not found and cannot apt-get install it; the tests that need it will fail" >&2
  fi
fi
if [ "$WITH_FLOWER" = 1 ]; then
  fstamp=.venv-flower/.rfedray-stamp
  fwant=$(cat benchmarks/flower/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$fstamp" 2>/dev/null)" != "$fwant" ]; then
    echo "setup: making Flower's environment (.venv-flower)"
    [ -x .venv-flower/bin/python ] || "$PY" -m venv .venv-flower
    .venv-flower/bin/python -m pip install -q -c benchmarks/flower/constraints.txt \
      "torch==$(grep '^torch==' benchmarks/flower/constraints.txt | cut -d= -f3)"
    # The extra's requirements, read from pyproject.toml (rfedray itself is not installed there).
    mapfile -t extra < <(.venv/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["flower"]))')
    .venv-flower/bin/python -m pip install -q -c benchmarks/flower/constraints.txt "${extra[@]}"
    echo "$fwant" > "$fstamp"
  fi
fi
echo "setup: ready (.venv)"
