#!/usr/bin/env bash
# The GPU acceptance run: bash scripts/gpu-acceptance.sh [OUT] [--budget_s S] [--checks a,b] [--dry]
# Runs from this source tree (PYTHONPATH, nothing installed) on the torch already there; prints one table and
# writes it to OUT/gpu-acceptance.md (default OUT: a new directory under /tmp). Without a GPU it runs its dry
# check on the CPU and exits 0. The checks and their targets: docs/testing.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# $PYTHON if set; else .venv's Python when its torch sees a GPU (a CUDA build on a GPU machine), else the
# machine's python3 if it has torch, else .venv's (the dry check on a CPU-only checkout)
venv="$root/.venv/bin/python"
has_torch() { "$1" -c "import sys, torch; sys.exit(not ($2))" 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x "$venv" ] && has_torch "$venv" "torch.cuda.is_available()"; then
    py="$venv"
elif command -v python3 >/dev/null && has_torch python3 True; then
    py=python3
elif [ -x "$venv" ]; then
    py="$venv"
else
    echo "gpu-acceptance: no Python with torch found (python3, $venv)" >&2
    exit 2
fi
cd "$root"
exec "$py" -m foldtrain.bench.gpu_acceptance "$@"
