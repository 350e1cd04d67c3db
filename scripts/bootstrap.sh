#!/usr/bin/env bash
# Sets up torch_gradops on a fresh machine and runs one job:
#   bash scripts/bootstrap.sh demo   -> python -m torch_gradops.demo
#   bash scripts/bootstrap.sh test   -> the whole test suite
# Idempotent: a second run only re-checks the installed packages and rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TORCH_GRADOPS_VENV:-.venv}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.torch_gradops_deps"
want="$(cat requirements.txt)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$PY" -m pip install -q --upgrade pip setuptools wheel ninja
  # torch first, pinned: the other packages must not pull a different build.
  "$PY" -m pip install -q "torch==2.14.1"
  "$PY" -m pip install -q -r requirements.txt
  printf '%s' "$want" > "$stamp"
fi

# Build the extension in place (ninja rebuilds only what changed). Without a GPU the CUDA
# sources still compile, for Ampere and Hopper, unless TORCH_GRADOPS_CUDA=0.
export MAX_JOBS="${MAX_JOBS:-2}"
"$PY" setup.py -q build_ext --inplace >"$VENV/build.log" 2>&1 || { cat "$VENV/build.log"; exit 1; }
# Make the in-place build importable from anywhere in this venv (what an editable install does).
"$PY" -c "import site, os; open(os.path.join(site.getsitepackages()[0], 'torch_gradops_dev.pth'), 'w').write(os.getcwd())"
"$PY" -c "import torch_gradops as t; print('torch_gradops', t.__version__, '| CUDA kernels compiled:', t.built_with_cuda())"

job="${1:-demo}"
shift || true

# The test job also covers PyG's torch_sparse inputs and NeighborLoader, whose backends PyPI
# ships as sources only: built once per venv (about 10 minutes on 2 cores), then skipped.
# TORCH_GRADOPS_SPARSE=0 skips them (their tests then skip too).
if [ "$job" = test ] && [ "${TORCH_GRADOPS_SPARSE:-1}" = 1 ]; then
  sstamp="$VENV/.torch_gradops_sparse"
  swant="$(cat requirements-sparse.txt)"
  if [ ! -f "$sstamp" ] || [ "$(cat "$sstamp")" != "$swant" ]; then
    echo "building torch-scatter and torch-sparse from source (once per venv)"
    FORCE_CUDA=0 "$PY" -m pip install -q --no-build-isolation -r requirements-sparse.txt
    printf '%s' "$swant" > "$sstamp"
  fi
fi
case "$job" in
  demo) exec "$PY" -m torch_gradops.demo "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/bootstrap.sh demo|test [args...]" >&2; exit 2 ;;
esac
