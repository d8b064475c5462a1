"""The GPU acceptance run's checks across devices: NCCL equivalence and short ``bench dp`` / ``bench pipeline``.

Equivalence runs in one torchrun launch (``python -m foldtrain.bench.gpu_multi RESULT.json DEVICE``): for every
``--dp.strategy`` that runs under torchrun, and for a pipeline x tensor-parallel layout pair, each rank builds
the engine ``foldtrain train`` builds (and the 3D engine's data parallelism with ``--optim.distributed``), trains
a few steps of a small GPT on seeded synthetic batches, and
rank 0 compares every step's loss and the final parameters with the single-process engine on the same global
batch (as tests/parallel's equivalence tests do on gloo). Four devices give dp 2 x pp 2 and pp 2 x tp 2; two
or three give pp 2 and tp 2. The distributed optimizer's case also saves a checkpoint (in slices, nothing
gathered) and loads it into an engine built from other weights, which must then hold exactly the saved ones. In the
dry mode the same launch runs on the CPU over gloo.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

from foldtrain.bench.gpu_checks import Ctx, loss_error, param_error, params_f64, row, run_cmd, set_fp32_exact, tail

STEPS, TOL = 5, 1e-5
# the small GPT, batches and learning rate of tests/parallel/pipeline's equivalence cases (tests/equivalence.py)
MODEL = {
    "--model.n_layer": 8,
    "--model.n_head": 2,
    "--model.d_model": 16,
    "--model.context": 16,
    "--model.vocab_size": 64,
    "--train.seq_len": 8,
    "--train.global_batch": 8,
    "--optim.lr": 1e-2,
    "--optim.min_lr": 1e-3,
    "--optim.warmup_steps": 2,
}
STRATEGIES = ("ddp", "allreduce", "ps", "sharded-ps", "fsdp")  # horovod needs horovodrun; none is the reference


def cases(world: int) -> dict[str, list[str]]:
    """Case name -> train options, for a launch of ``world`` ranks."""
    out = {f"dp{world} {s}": ["--dp.strategy", s] for s in STRATEGIES}
    # the 3D engine's data parallelism with the distributed optimizer: reduce-scatter and all-gather on NCCL
    out[f"dp{world} distributed optimizer"] = ["--train.micro_batch", "2", "--parallel.dp", str(world)]
    out[f"dp{world} distributed optimizer"] += ["--optim.distributed", "true"]
    pipe = ["--train.micro_batch", "2", "--parallel.virtual", "2", "--parallel.schedule", "fold"]
    pipe += ["--parallel.dp_sync", "per-chunk"]
    tp = ["--train.micro_batch", "2", "--parallel.schedule", "1f1b"]
    if world >= 4:
        out["dp2 x pp2 fold"] = [*pipe, "--parallel.dp", "2", "--parallel.pp", "2"]
        out["pp2 x tp2 1f1b"] = [*tp, "--parallel.pp", "2", "--parallel.tp", "2"]
    else:
        out["pp2 fold"] = [*pipe, "--parallel.pp", "2"]
        out["tp2 1f1b"] = [*tp, "--parallel.tp", "2"]
    return out


class SyntheticBatches:
    """Seeded token batches: step ``s``'s global batch is the same in every process; a rank takes its rows."""

    def __init__(self, vocab: int, seq_len: int):
        self.vocab, self.seq_len = vocab, seq_len

    def rank_batch(self, step: int, global_batch: int, rank: int, world: int):
        g = torch.Generator().manual_seed(1000 + step)
        seq = torch.randint(0, self.vocab, (global_batch, self.seq_len + 1), generator=g)
        per = global_batch // world
        rows = seq[rank * per : (rank + 1) * per]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def case_config(args: list[str], device: str):
    from foldtrain.config import build_config

    return build_config([*(str(x) for kv in MODEL.items() for x in kv), "--train.device", device, *args])


def _engine(cfg, env):
    from foldtrain.config import dp_workers
    from foldtrain.engine import build_engine
    from foldtrain.schedules.layout import uses_3d_engine
    from foldtrain.train.trainer import build_model

    micro = cfg.train.micro_batch or cfg.train.global_batch // dp_workers(cfg, env.world_size)
    return build_engine(cfg, build_model(cfg, meta=uses_3d_engine(cfg)), env, micro)


def reloaded(cfg, env, engine, where: Path) -> dict | None:
    """``engine``'s state saved with ``CheckpointManager`` under ``where`` and loaded into an engine built from
    other weights: that engine's whole model (rank 0; None elsewhere). Collective."""
    import copy

    from foldtrain.checkpoint import CheckpointManager

    ckpt = CheckpointManager(where)
    path = ckpt.save(STEPS, engine.state_dict(), {"step": STEPS})
    other = copy.deepcopy(cfg)
    other.train.seed += 1
    fresh = _engine(other, env)
    state = fresh.state_dict()
    ckpt.load(path, state)
    fresh.load_state_dict(state)
    model = fresh.eval_model()
    return params_f64(model) if env.rank == 0 and model is not None else None


def train_case(cfg, env, ckpt_dir: Path | None = None) -> tuple[list[float], dict | None, dict | None]:
    """This rank's engine for ``cfg`` trained ``STEPS`` steps: the losses, and the whole final model's parameters
    on rank 0 (None elsewhere); with ``ckpt_dir`` also those of an engine that loaded its checkpoint
    (:func:`reloaded`). Collective."""
    from foldtrain.config import validate

    validate(cfg, env.world_size)
    engine = _engine(cfg, env)
    batches = SyntheticBatches(cfg.model.vocab_size, cfg.train.seq_len)
    losses = [engine.train_step(*engine.batch(batches, s)) for s in range(STEPS)]
    engine.flush()
    model = engine.eval_model()
    again = reloaded(cfg, env, engine, ckpt_dir) if ckpt_dir is not None else None
    if env.rank != 0 or model is None:
        return losses, None, None
    return losses, params_f64(model), again


def reference(cfg, device: torch.device) -> tuple[list[float], dict]:
    """The single-process engine on the same global batches (micro-batches of the same size)."""
    from foldtrain.engine import ReplicatedEngine
    from foldtrain.model import GPT, GPTShape

    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTShape.from_config(cfg.model), cfg.train.seed)
    engine = ReplicatedEngine(model, cfg, device, cfg.train.micro_batch or cfg.train.global_batch)
    batches = SyntheticBatches(cfg.model.vocab_size, cfg.train.seq_len)
    losses = [engine.train_step(*batches.rank_batch(s, cfg.train.global_batch, 0, 1)) for s in range(STEPS)]
    return losses, params_f64(engine.eval_model())


def run_cases(env, device: str, work: Path) -> dict[str, dict]:
    """Every case of this launch; on rank 0 each one's errors against the reference (or the error it raised).
    The distributed optimizer's case also saves a checkpoint (its slices, not gathered) and reloads it."""
    results = {}
    for k, (name, args) in enumerate(cases(env.world_size).items()):
        t0 = time.perf_counter()
        try:
            cfg = case_config(args, device)
            ckpt_dir = work / f"checkpoints-{k}" if "distributed optimizer" in name else None
            losses, params, again = train_case(cfg, env, ckpt_dir)
            if env.rank == 0:
                ref_losses, ref_params = reference(cfg, env.device)
                loss_err = loss_error(losses, ref_losses)
                err, worst = param_error(params, ref_params, cfg.model.n_head)
                results[name] = {"loss_err": loss_err, "param_err": err, "worst": worst}
                if again is not None:  # the reloaded engine holds exactly the saved weights
                    results[name]["reload_err"] = param_error(again, params, cfg.model.n_head)[0]
        except Exception as e:  # noqa: BLE001 - recorded as the case's row; the next case still runs
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        if name in results:
            results[name]["seconds"] = time.perf_counter() - t0
    return results


def main(argv: list[str] | None = None) -> int:
    from foldtrain.distributed import init_distributed, shutdown

    result_file, device = (argv or sys.argv[1:])[:2]
    set_fp32_exact()
    env = init_distributed(device, 120.0)
    try:
        results = run_cases(env, device, Path(result_file).parent)
        if env.rank == 0:
            Path(result_file).write_text(json.dumps({"world": env.world_size, "cases": results}, indent=1))
    finally:
        shutdown()
    return 0


# ---------------------------------------------------------------------- the driver's checks


def ranks(ctx: Ctx) -> int:
    """Ranks of the multi-device checks: 4 with four devices or more, else 2 (the dry mode: 2 CPU processes)."""
    return 2 if ctx.dry else (4 if torch.cuda.device_count() >= 4 else 2)


def check_equivalence(ctx: Ctx) -> list[dict]:
    """The torchrun launch of :func:`main`, one row per case."""
    world, device = ranks(ctx), "cpu" if ctx.dry else "cuda"
    backend = "gloo" if ctx.dry else "NCCL"
    result = ctx.work / "equivalence.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    rc, text = run_cmd([*cmd, "-m", "foldtrain.bench.gpu_multi", str(result), device], ctx.left() - 3)
    if rc != 0 or not result.is_file():
        status = "timed out" if rc is None else f"exit {rc}"
        return [row(f"{backend} equivalence, {world} ranks", f"launch {status}: {tail(text, 3)}", "", False)]
    rows = []
    for name, r in json.loads(result.read_text())["cases"].items():
        target = f"losses and parameters <= {TOL:g} relative to one process"
        if "error" in r:
            rows.append(row(f"{backend} {name}", r["error"], target, False))
            continue
        worst = max(r["loss_err"], r["param_err"])
        measured = f"losses {r['loss_err']:.1e}, parameters {r['param_err']:.1e} ({r['worst']}), {STEPS} steps"
        ok = worst <= TOL
        want = target
        if "reload_err" in r:  # its checkpoint, saved in slices, reloaded into other weights: exactly the same
            measured += f"; reloaded from its checkpoint: {r['reload_err']:.1e}"
            want += "; its checkpoint reloaded into other weights: identical"
            ok = ok and r["reload_err"] == 0.0
        rows.append(row(f"{backend} {name}", measured, want, ok))
    return rows


def check_calibrate_links(ctx: Ctx) -> list[dict]:
    """``foldtrain calibrate`` under torchrun on every device: the collectives' bus bandwidth among them and
    ``device.overlap_slowdown`` (compute beside their all-reduces), read back from the cluster file it writes."""
    from foldtrain.sim.cluster import load_cluster

    world, out = ranks(ctx), ctx.out / "cluster-links.toml"
    out.unlink(missing_ok=True)
    probes = ["--device", "cpu", "--probes", "kernels", "--precision", "fp32"] if ctx.dry else ["--device", "cuda"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += ["-m", "foldtrain", "calibrate", *probes, "--preset", "tiny", "--micro_batch", "2", "--seq", "32"]
    rc, text = run_cmd([*cmd, "--out", str(out)], ctx.left() - 3)
    name = f"calibrate under torchrun ({'gloo dry run' if ctx.dry else 'NCCL'}), {world} ranks"
    target = "the link's bus bandwidth and the compute beside its all-reduces measured"
    if rc != 0 or not out.is_file():
        status = "timed out" if rc is None else f"exit {rc}"
        return [row(name, f"{status}: {tail(text, 2)}", target, False)]
    c = load_cluster(str(out))
    line = next((ln for ln in out.read_text().splitlines() if ln.startswith("overlap_slowdown")), "")
    # measured, not the --links preset's (a measured 0 is a default the file leaves out)
    measured = "# measured on the" in line or (not line and c.overlap_slowdown == 0.0)
    what = f"all-reduce bus bandwidth {c.intra.bw / 1e9:.3g} GB/s, compute beside it {c.overlap_slowdown:+.1%}"
    return [row(name, what, target, measured and c.intra.bw > 0)]


def bench_command(ctx: Ctx, which: str) -> list[str]:
    """``foldtrain bench dp|pipeline``, short, on loopback: NCCL on the devices, or its dry run on the CPU."""
    world = ranks(ctx)
    cmd = [sys.executable, "-m", "foldtrain", "bench", which, "--quick", "--networks", "loopback"]
    cmd += ["--data", ctx.state["data"], "--out", str(ctx.work / f"bench-{which}")]
    cmd += ["--report", str(ctx.work / f"bench-{which}.md")]
    if which == "dp":
        cmd += ["--ranks", str(world), "--strategies", ",".join(STRATEGIES), "--anchors", "ddp_plain"]
        cmd += ["--precisions", "fp32" if ctx.dry else "bf16"]
    else:
        cmd += ["--dp", str(world // 2), "--pp", "2", "--schedules", "1f1b,fold", "--anchors", "torch"]
        cmd += ["--torch_schedules", "1f1b"]
    return cmd + (["--device", "cpu", "--dry_run"] if ctx.dry else ["--device", "cuda"])


def check_bench(ctx: Ctx, which: str) -> list[dict]:
    """One row: whether the benchmark ran; its own table goes into the report's appendix."""
    t0 = time.perf_counter()
    rc, text = run_cmd(bench_command(ctx, which), ctx.left() - 3)
    took = time.perf_counter() - t0
    report = ctx.work / f"bench-{which}.md"
    if report.is_file():
        ctx.state.setdefault("appendix", {})[f"foldtrain bench {which}"] = report.read_text()
    elif rc == 0:
        ctx.state.setdefault("appendix", {})[f"foldtrain bench {which} (dry run)"] = text
    status = "timed out" if rc is None else f"exit {rc}"
    measured = f"{status} in {took:.0f} s" + ("" if rc == 0 else f": {tail(text, 2)}")
    net = "gloo dry run" if ctx.dry else "NCCL"
    return [row(f"foldtrain bench {which} ({net})", measured, "every row ran (table below)", rc == 0)]


if __name__ == "__main__":
    sys.exit(main())
