"""The pipeline executor's own host work per action, from a real pipeline of a negligible model (2 ranks,
or 2 stages x ``dp`` replicas: the host work of one rank grows when more processes share the cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from foldtrain.errors import FoldtrainError

EXECUTOR_PROBE = [
    "--model.preset",
    "tiny",
    "--model.n_layer",
    "4",
    "--model.d_model",
    "16",
    "--model.n_head",
    "2",
    "--train.seq_len",
    "8",
    "--train.global_batch",
    "16",
    "--parallel.pp",
    "2",
    "--parallel.virtual",
    "2",
    "--parallel.microbatches",
    "16",
    "--parallel.schedule",
    "interleaved-1f1b",
]
EXECUTOR_STEPS = 16


def measure_action_overhead(cluster, dp: int = 1) -> tuple[float, float, float]:
    """The pipeline executor's own host work per action: a real 2-stage pipeline, ``dp`` replicas of it
    (``2 dp`` ranks; ``foldtrain train``, ``torchrun --standalone``), of a negligible model with 16
    micro-batches per replica, so that its step is nearly all executor (bookkeeping, posting and
    waiting for transfers, waking up), against the simulator's step of the same run on ``cluster``
    without it, per action of a rank's list. Returns ``(overhead_s,
    measured_step_s, simulated_step_s)``."""
    import dataclasses
    import shutil
    import statistics

    from foldtrain.config import build_config
    from foldtrain.data import resolve_data
    from foldtrain.schedules import build_schedule
    from foldtrain.sim.simulate import simulate

    if dp < 1:
        raise FoldtrainError(f"calibrate: the executor probe needs dp >= 1 replicas, not {dp}")
    # 16 micro-batches of 1 per replica
    probe = [*EXECUTOR_PROBE, "--parallel.dp", str(dp), "--train.global_batch", str(16 * dp)]
    cfg = build_config(probe)
    data = str(resolve_data(cfg.data))  # the built-in corpus (prepared once, then cached)
    out = tempfile.mkdtemp(prefix="ft-cal-exec-")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(2 * dp),
        "-m",
        "foldtrain",
        "train",
        *probe,
        "--data.path",
        data,
        "--train.steps",
        str(EXECUTOR_STEPS),
        "--train.eval_every",
        "0",
        "--train.log_every",
        "1",
        "--out",
        out,
    ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if p.returncode != 0:
            raise FoldtrainError(
                "calibrate: the pipeline executor probe failed: "
                f"{((p.stderr or p.stdout).strip().splitlines() or [''])[-1]}"
            )
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > EXECUTOR_STEPS // 3]
    measured = statistics.median(steps)
    sim = simulate(cfg, dataclasses.replace(cluster, action_overhead=0.0, memory=1e12))
    s = sim.setup
    actions = max(
        len(acts) for acts in build_schedule(s.schedule, s.pp, s.virtual, s.microbatches, s.dp_sync, s.defer).ranks
    )
    return max(0.0, (measured - sim.step_time) / actions), measured, sim.step_time
