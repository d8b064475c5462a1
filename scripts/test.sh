#!/usr/bin/env bash
# Install foldtrain with its test extras and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,plots,bench
# Horovod builds from source (a few minutes); where it cannot be built its tests are skipped and say why
bash scripts/install-horovod.sh .venv/bin/python || echo "test.sh: Horovod could not be built; its tests will be skipped and say so" >&2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q "$@"
