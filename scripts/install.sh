#!/usr/bin/env bash
# Create .venv (if missing) and install foldtrain with its dependencies.
# On a machine without an NVIDIA GPU, torch comes as the pinned CPU build torch==2.13.0;
# with a GPU, an already installed (CUDA) torch is kept, else pip's default build is used.
# Usage: scripts/install.sh [EXTRAS]   e.g. scripts/install.sh test,plots,tensorboard
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-plots,tensorboard}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch
  else
    .venv/bin/python -m pip install -q torch==2.13.0
  fi
fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
.venv/bin/python -c "import torch, foldtrain; print(f'foldtrain {foldtrain.__version__} with torch {torch.__version__} ready in .venv')"
