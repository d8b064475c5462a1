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
    waiting for transfers, waking up), against the simulator's step of the same run on ``cluster``:
    the core-seconds per action that make the simulated step the measured one (:func:`solve_overhead`).
    Returns ``(overhead_s, measured_step_s, simulated_step_s)``, the last without the overhead."""
    import dataclasses

    from foldtrain.sim.simulate import simulate

    if dp < 1:
        raise FoldtrainError(f"calibrate: the executor probe needs dp >= 1 replicas, not {dp}")
    cfg, measured = probe_step(dp)

    def simulated(overhead: float) -> float:
        return simulate(cfg, dataclasses.replace(cluster, action_overhead=overhead, memory=1e12)).step_time

    return solve_overhead(measured, simulated), measured, simulated(0.0)


def probe_step(dp: int, extra: tuple[str, ...] = ()):
    """``(config, median step seconds)`` of the executor's probe with ``dp`` replicas (16 micro-batches of 1
    each) and the options ``extra``, trained for :data:`EXECUTOR_STEPS` steps under ``torchrun --standalone``;
    the steps of the first third are left out (warm-up)."""
    import shutil
    import statistics

    from foldtrain.config import build_config
    from foldtrain.data import resolve_data

    probe = [*EXECUTOR_PROBE, "--parallel.dp", str(dp), "--train.global_batch", str(16 * dp), *extra]
    cfg = build_config(probe)
    data = str(resolve_data(cfg.data))  # the built-in corpus (prepared once, then cached)
    out = tempfile.mkdtemp(prefix="ft-cal-exec-")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(2 * dp)]
    cmd += ["-m", "foldtrain", "train", *probe, "--data.path", data, "--train.steps", str(EXECUTOR_STEPS)]
    cmd += ["--train.eval_every", "0", "--train.log_every", "1", "--out", out]
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
    return cfg, statistics.median(steps)


def solve_overhead(measured: float, simulated, probe: float = 1e-3) -> float:
    """The overhead ``x`` (seconds per action) with ``simulated(x) == measured``, 0 when the step without it is
    already as long. The simulator charges an action's overhead as work on the rank's core: where more ranks
    than cores are busy, as on the probe's shared cores, each second of it takes longer than a second of the
    step, so dividing the measured excess by the actions would count the cores' sharing twice. The simulated
    step grows linearly with ``x`` (every action pays it), so one secant from ``x = 0`` finds it; a second from
    there absorbs what little is not linear."""
    lo = simulated(0.0)
    if measured <= lo:
        return 0.0
    grown = simulated(probe) - lo
    if grown <= 0:
        raise FoldtrainError("calibrate: the simulated probe does not grow with the executor's work per action")
    x = probe * (measured - lo) / grown
    at = simulated(x)
    return max(0.0, x + x * (measured - at) / (at - lo)) if at > lo else x
