#!/bin/bash
# Loopback A/B of two foldtrain trees on the pipeline benchmark's layout (docs/benchmarks.md, "Loopback A/B of two code trees").
# usage: scripts/ab_loopback.sh OLD_TREE NEW_TREE [ROUNDS] [STEPS] [pipeline|dp]
#   e.g. git worktree add /tmp/old 8bbedbd && scripts/ab_loopback.sh /tmp/old . 6 20
# Alternates the trees in rounds and prints each run's median tokens/s after step 3, on the wall period between
# steps (metrics' time_s: what runs between steps included, as the benches' step time). pipeline (the
# default): interleaved-1f1b after-flush and fold per-chunk, 4 ranks: dp 2 x pp 2, V 2, 8 layers,
# d 256, 8 x 32 tokens. dp: the data-parallel strategies sharded-ps and allreduce, tiny, on NPROC
# ranks (default 4; 2 leaves each rank a core of its own on this 2-core machine).
set -euo pipefail
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); ROUNDS=${3:-6}; STEPS=${4:-20}; WHAT=${5:-pipeline}
PY=${PYTHON:-$(command -v python)}
wall_tokens_per_s() { # metrics.jsonl -> median tokens/s after step 3, on the wall period between consecutive steps' time_s
  "$PY" -c 'import json,statistics,sys
r=[x for x in map(json.loads,open(sys.argv[1])) if "tokens_per_s" in x and "time_s" in x]
print(round(statistics.median(b["tokens_per_s"]*b["step_time_s"]/(b["time_s"]-a["time_s"]) for a,b in zip(r,r[1:]) if a["step"]>=3 and b["step"]==a["step"]+1)))' "$1"
}
run() { # tree schedule sync
  local out; out=$(mktemp -d /tmp/ft-ab.XXXX)
  (cd "$1" && OMP_NUM_THREADS=1 PYTHONPATH=. "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 -m foldtrain train \
    --model.preset tiny --model.n_layer 8 --model.d_model 256 --train.global_batch 8 --train.seq_len 32 \
    --parallel.dp 2 --parallel.pp 2 --parallel.virtual 2 --parallel.microbatches 4 \
    --parallel.schedule "$2" --parallel.dp_sync "$3" --optim.grad_clip 0 --train.steps "$STEPS" \
    --train.log_every 1 --train.eval_every 0 --checkpoint.every 0 --train.progress false --out "$out" > "$out/log" 2>&1)
  wall_tokens_per_s "$out/metrics.jsonl"
}
run_dp() { # tree strategy
  local out; out=$(mktemp -d /tmp/ft-ab.XXXX)
  (cd "$1" && OMP_NUM_THREADS=1 PYTHONPATH=. "$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-4}" -m foldtrain train \
    --model.preset tiny --dp.strategy "$2" --train.steps "$STEPS" \
    --train.log_every 1 --train.eval_every 0 --checkpoint.every 0 --train.progress false --out "$out" > "$out/log" 2>&1)
  wall_tokens_per_s "$out/metrics.jsonl"
}
if [ "$WHAT" = dp ]; then
  for r in $(seq "$ROUNDS"); do
    for s in sharded-ps allreduce; do
      echo "round $r $s old $(run_dp "$OLD" "$s") new $(run_dp "$NEW" "$s")"
    done
  done
  exit 0
fi
for r in $(seq "$ROUNDS"); do
  for s in "interleaved-1f1b after-flush" "fold per-chunk"; do
    set -- $s
    echo "round $r $1 old $(run "$OLD" "$1" "$2") new $(run "$NEW" "$1" "$2")"
  done
done
