#!/bin/bash
# What torchrun starts on every rank (with --no-python): `foldtrain train "$@"`, plus --resume once the
# run directory holds a checkpoint, so that a restart by --max-restarts, and a Slurm job requeued by
# train.sbatch (or after a node failure or preemption), continues the run from its latest checkpoint
# instead of refusing to overwrite it. Give --out as two words (--out DIR); the last --out counts.
set -euo pipefail
out=runs/default
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
  if [ "${args[i]}" = --out ]; then out="${args[i + 1]}"; fi
done
resume=()
if compgen -G "$out/checkpoints/step_*[0-9]" > /dev/null; then resume=(--resume); fi
exec "${PYTHON:-.venv/bin/python}" -m foldtrain train "$@" "${resume[@]}"
