#!/usr/bin/env bash
# Install foldtrain, prepare the built-in default corpus (the Python standard library's source)
# and train a small GPT on it with a live progress bar; ends with a sample of generated text.
# Extra arguments are passed to `foldtrain train` (e.g. --train.steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh plots,tensorboard
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
out="${OUT:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}"
.venv/bin/foldtrain train --out "$out" --train.sample_prompt "def " "$@"
echo "run written to $out  (try: .venv/bin/foldtrain generate --out $out --prompt 'def ')"
