"""The one-device checks of the GPU acceptance run (:mod:`foldtrain.bench.gpu_acceptance`), and what every
check shares: its context, its rows, its time limit and its child processes.

Each check takes a :class:`Ctx` and returns rows (check, measured, target, verdict). On a GPU it runs at the
issue's scale (:data:`GPU`); in the dry mode the same code runs on the CPU at :data:`DRY` scale, where the
verdicts say only that the code ran. Results a later check needs (the measured runs, the cluster file) go
into ``ctx.state``, which the worker saves after every check.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

GB = 1e9


@dataclass(frozen=True)
class Scale:
    corpus_mb: float  # text from the standard library, prepared once for every check
    tiny: tuple[int, int, int]  # CUDA against CPU: steps, batch, sequence length
    half: tuple[str, int, int, int]  # bf16 / fp16: preset, steps, batch, sequence length
    speed: dict[str, tuple[str, tuple[int, ...]]]  # throughput: label -> preset run, micro-batches to probe
    speed_seq: int
    window: int  # timed steps per alternation
    reps: int  # alternations of plain loop and foldtrain
    warm: int  # steps left out before timing
    half_lr: tuple[str, ...] = ()
    fall: float = 1.0  # nats the loss must fall by (mean of the first against the last eighth of the steps)


GPU = Scale(
    corpus_mb=8.0,
    tiny=(5, 8, 128),
    half=("gpt2-small", 40, 8, 1024),
    speed={
        "gpt2-small": ("gpt2-small", (8, 16, 32, 64)),
        "gpt2-medium": ("gpt2-medium", (4, 8, 16, 32)),
        "gpt2-large": ("gpt2-large", (4, 8, 16, 32)),
    },
    speed_seq=1024,
    window=8,
    reps=3,
    warm=3,
    half_lr=("--optim.lr", "6e-4", "--optim.min_lr", "6e-5", "--optim.warmup_steps", "10"),  # GPT-3 Table 2.1, 125M
)
DRY = Scale(
    corpus_mb=0.3,
    tiny=(2, 4, 32),
    half=("tiny", 8, 4, 32),
    speed={"gpt2-small": ("tiny", (1, 2)), "gpt2-medium": ("tiny", (1, 2)), "gpt2-large": ("tiny", (1, 2))},
    speed_seq=32,
    window=2,
    reps=1,
    warm=1,
    half_lr=("--optim.warmup_steps", "1"),
    fall=0.2,
)


@dataclass
class Ctx:
    work: Path  # scratch: prepared data, run directories, the worker's events and state
    out: Path  # what the run hands back: the report, its log, the calibrated cluster file
    dry: bool
    device: torch.device
    deadline: float  # time.time() by which the whole run must be done
    state: dict = field(default_factory=dict)
    check_end: float = float("inf")  # time.time() by which the current check must be done

    @property
    def scale(self) -> Scale:
        return DRY if self.dry else GPU

    def left(self) -> float:
        """Seconds left to the current check (at least 1)."""
        return max(min(self.deadline, self.check_end) - time.time(), 1.0)


def row(check: str, measured: str, target: str, ok: bool | None, ran: bool = True) -> dict:
    """One line of the report; ``ok`` None: a figure with no target; ``ran`` False: the check did not complete
    (it raised, ran out of time, took its worker down, or was not started)."""
    return {"check": check, "measured": measured, "target": target, "ok": ok, "ran": ran}


# ---------------------------------------------------------------------- limits and child processes


class CheckTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CheckTimeout` in this (main) thread once ``seconds`` have passed."""

    def fire(_signum, _frame):
        raise CheckTimeout(f"timed out after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def child_env() -> dict[str, str]:
    """The environment of a child process: this source tree first on the path."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


def run_cmd(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a process group of its own (torchrun's workers included); its exit status (None when
    it ran out of time and was killed) and its output. The group is killed however this returns."""
    print("  $ " + " ".join(cmd), flush=True)
    timeout = max(timeout, 1.0)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=child_env()
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        return None, out
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (torchrun passes it on to its workers), SIGKILL what is left after 5 s."""
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers a dead launcher left behind
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def tail(text: str, n: int = 1) -> str:
    """The last ``n`` non-empty lines of ``text``, joined by ' / '."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(lines[-n:]) if lines else "(no output)"


# ---------------------------------------------------------------------- configs, data, engines


def set_fp32_exact() -> None:
    """Full fp32 matrix products and convolutions on CUDA (no TF32), so that CUDA can match the CPU to 1e-5."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def config(
    ctx: Ctx, preset: str, precision: str, batch: int, seq: int, steps: int, extra=(), device: str = "", check=True
):
    """A train config of ``preset`` on the prepared data, one micro-batch of ``batch`` rows per step (validated
    as for one process unless ``check`` is False)."""
    from foldtrain.config import build_config, validate

    args = {
        "--model.preset": preset,
        "--precision": precision,
        "--train.global_batch": batch,
        "--train.micro_batch": batch,
        "--train.seq_len": seq,
        "--train.steps": steps,
        "--train.device": device or ctx.device.type,
        "--data.path": ctx.state["data"],
        "--out": ctx.work / "run",
    }
    cfg = build_config([str(x) for kv in args.items() for x in kv] + list(extra))
    if check:
        validate(cfg, 1)
    return cfg


def sampler_for(cfg):
    from foldtrain.data import SequenceSampler
    from foldtrain.train.trainer import open_data

    return SequenceSampler(open_data(cfg).split("train"), cfg.train.seq_len, cfg.train.seed)


def engine_for(cfg, device: torch.device):
    """The engine ``foldtrain train`` builds for ``cfg`` in one process on ``device``, from its initial weights."""
    from foldtrain.distributed import DistEnv
    from foldtrain.engine import build_engine
    from foldtrain.train.trainer import build_model

    return build_engine(cfg, build_model(cfg), DistEnv(0, 1, 0, device), cfg.train.micro_batch)


def engine_steps(engine, sampler, start: int, steps: int) -> tuple[list[float], list[float]]:
    """Losses and seconds of the engine's steps ``start ..`` as the trainer times them (batch + step)."""
    losses, times = [], []
    for s in range(start, start + steps):
        t0 = time.perf_counter()
        losses.append(engine.train_step(*engine.batch(sampler, s)))
        times.append(time.perf_counter() - t0)
    return losses, times


# ---------------------------------------------------------------------- the checks


def check_data(ctx: Ctx) -> list[dict]:
    """Standard-library text into a prepared token directory every later check trains on."""
    from foldtrain.data import prepare
    from foldtrain.data.sources import default_corpus_files, read_default_file

    t0 = time.perf_counter()
    corpus, size = ctx.work / "corpus.txt", 0
    with open(corpus, "w") as f:
        for path in default_corpus_files():
            text = read_default_file(path)
            if text:
                f.write(text + "\n")
                size += len(text)
            if size >= ctx.scale.corpus_mb * 1e6:
                break
    meta = prepare(corpus, ctx.work / "data", vocab_size=8192, quiet=True, val_fraction=0.01)
    ctx.state["data"] = str(ctx.work / "data")
    tokens = meta["splits"]["train"]["tokens"]
    took = time.perf_counter() - t0
    return [row("data", f"{tokens:,} train tokens, vocab {meta['vocab_size']} ({took:.0f} s)", "prepared", True)]


def key_bias_free(name: str, t: torch.Tensor, n_head: int) -> torch.Tensor:
    """``t`` without the attention's key biases (the loss does not depend on them: their gradient is rounding
    noise that AdamW makes full-size, as tests/equivalence.py explains), for ``attn.qkv.bias``."""
    if not name.endswith("attn.qkv.bias"):
        return t
    return t.reshape(n_head, 3, -1)[:, [0, 2]].reshape(-1)


def param_error(got: dict, ref: dict, n_head: int) -> tuple[float, str]:
    """The largest |a - b| / |b| (2-norm over a tensor, float64) over the tensors of ``ref``, and its name."""
    errs = {}
    for name, b in ref.items():
        a, b = key_bias_free(name, got[name], n_head).double(), key_bias_free(name, b, n_head).double()
        errs[name] = float((a - b).norm() / b.norm().clamp_min(1e-12))
    name = max(errs, key=errs.get)
    return errs[name], name


def params_f64(model) -> dict:
    """``model``'s parameters by name, as float64 tensors on the CPU (what :func:`param_error` compares)."""
    return {n: p.detach().to("cpu", torch.float64) for n, p in model.named_parameters()}


def loss_error(got: list[float], ref: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))


def trained(cfg, device: torch.device, steps: int) -> tuple[list[float], dict]:
    """The losses of ``steps`` steps of the engine for ``cfg`` on ``device``, and its final parameters."""
    engine = engine_for(cfg, device)
    losses, _ = engine_steps(engine, sampler_for(cfg), 0, steps)
    return losses, params_f64(engine.eval_model())


def check_cuda_vs_cpu(ctx: Ctx) -> list[dict]:
    """``tiny`` in fp32, the same 5 steps on the CPU and on the device: losses and parameters within 1e-5."""
    set_fp32_exact()
    steps, batch, seq = ctx.scale.tiny
    runs = []
    for dev in (torch.device("cpu"), ctx.device):
        cfg = config(ctx, "tiny", "fp32", batch, seq, steps, device=dev.type)
        runs.append(trained(cfg, dev, steps))
    (cpu_losses, cpu_params), (dev_losses, dev_params) = runs
    loss_err = loss_error(dev_losses, cpu_losses)
    err, name = param_error(dev_params, cpu_params, cfg.model.n_head)
    what = f"{ctx.device.type} vs cpu, tiny fp32, {steps} steps, TF32 off"
    return [
        row("CUDA vs CPU: losses", f"{loss_err:.1e} relative ({what})", "<= 1e-5", loss_err <= 1e-5),
        row(
            "CUDA vs CPU: parameters", f"{err:.1e} relative, worst {name}", "<= 1e-5 (key biases left out)", err <= 1e-5
        ),
    ]


def check_dataparallel(ctx: Ctx) -> list[dict]:
    """``--dp.strategy dataparallel`` (``torch.nn.DataParallel`` over every visible GPU, HP3C'22's SPS) against
    one device: ``tiny`` in fp32, the same steps, losses and parameters within 1e-5. In the dry mode the
    strategy's CPU path (DataParallel calls the replica directly), which validation refuses a user."""
    set_fp32_exact()
    steps, batch, seq = ctx.scale.tiny
    runs = []
    for strategy in ("none", "dataparallel"):
        extra = ("--dp.strategy", strategy)
        cfg = config(ctx, "tiny", "fp32", batch, seq, steps, extra, check=not (ctx.dry and strategy == "dataparallel"))
        runs.append(trained(cfg, ctx.device, steps))
    (one_losses, one_params), (dp_losses, dp_params) = runs
    loss_err = loss_error(dp_losses, one_losses)
    err, name = param_error(dp_params, one_params, cfg.model.n_head)
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    what = f"nn.DataParallel over {gpus} GPU(s) vs one {ctx.device.type} device, tiny fp32, {steps} steps"
    return [
        row(
            "dataparallel vs one device",
            f"losses {loss_err:.1e}, parameters {err:.1e} relative, worst {name} ({what})",
            "<= 1e-5 (key biases left out)",
            max(loss_err, err) <= 1e-5,
        )
    ]


def finite_mean(xs: list[float]) -> float:
    """The mean of the finite values of ``xs`` (nan if none is)."""
    finite = [x for x in xs if math.isfinite(x)]
    return statistics.fmean(finite) if finite else float("nan")


def longest_run(flags: list[bool]) -> int:
    best = cur = 0
    for f in flags:
        cur = cur + 1 if f else 0
        best = max(best, cur)
    return best


def check_half(ctx: Ctx, precision: str) -> list[dict]:
    """``gpt2-small`` in bf16 or fp16 (dynamic loss scaling): the loss falls; fp16 skips no run of steps."""
    preset, steps, batch, seq = ctx.scale.half
    cfg = config(ctx, preset, precision, batch, seq, steps, ctx.scale.half_lr)
    engine = engine_for(cfg, ctx.device)
    sampler, scaler = sampler_for(cfg), engine.precision.scaler
    losses, skipped = [], []
    for s in range(steps):
        before = scaler.skipped
        losses.append(engine.train_step(*engine.batch(sampler, s)))
        skipped.append(scaler.skipped > before)
    k = max(1, steps // 8)
    first, last = finite_mean(losses[:k]), finite_mean(losses[-k:])
    fell = first - last
    rows = [
        row(
            f"{precision} {preset}: loss falls",
            f"{first:.2f} -> {last:.2f} (mean of first / last {k} of {steps} steps, micro-batch {batch} x {seq})",
            f"falls by >= {ctx.scale.fall:.1f}",
            fell >= ctx.scale.fall,
        )
    ]
    if scaler.enabled:
        settle = max(1, steps // 5)  # the scale backs off from 2^16 at first: skips there are its search
        run = longest_run(skipped[settle:])
        rows.append(
            row(
                f"fp16 {preset}: overflow skips",
                f"{sum(skipped)} skipped of {steps}, longest run after step {settle}: {run}, scale {scaler.scale:g}",
                f"no 2 skips in a row after step {settle}",
                run <= 1,
            )
        )
    return rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> float:
    """torch.cuda.max_memory_allocated on a GPU; the process's peak RSS on the CPU (the trainer's own figure)."""
    from foldtrain.train.metrics import peak_memory_mb

    return peak_memory_mb(device) * 2**20


def measure_speed(ctx: Ctx, cfg, sampler) -> dict:
    """foldtrain's engine and the plain loop at ``cfg``'s micro-batch, alternated window by window; the
    engine's first window alone on the device gives the memory figure."""
    from foldtrain.bench.gpu_plain import PlainLoop

    s, dev, mb = ctx.scale, ctx.device, cfg.train.global_batch
    reset_peak(dev)
    engine = engine_for(cfg, dev)
    _, ft = engine_steps(engine, sampler, 0, s.warm + s.window)
    peak = peak_bytes(dev)
    ft, pos = ft[s.warm :], s.warm + s.window
    plain = PlainLoop(cfg, dev)
    plain.timed(sampler, mb, 0, s.warm)
    pl = []
    for _ in range(s.reps):
        pl += plain.timed(sampler, mb, pos, s.window)
        ft += engine_steps(engine, sampler, pos, s.window)[1]
        pos += s.window
    plain.close()
    return {"step_s": statistics.median(ft), "plain_step_s": statistics.median(pl), "peak_bytes": peak}


def check_speed(ctx: Ctx, label: str) -> list[dict]:
    """Throughput of ``label`` in bf16 at the fastest micro-batch that fits: tokens/s, MFU, and the ratio to the
    plain loop."""
    from foldtrain.bench.gpu_plain import (
        PlainLoop,
        device_peak_tflops,
        flops_per_token,
        free_device_memory,
        oom_error,
        probe_micro_batches,
    )

    preset, candidates = ctx.scale.speed[label]
    seq = ctx.scale.speed_seq
    base = config(ctx, preset, "bf16", candidates[0], seq, 10_000)
    sampler = sampler_for(base)
    loop = PlainLoop(base, ctx.device)
    mb, probes = probe_micro_batches(loop, sampler, candidates, seq)
    loop.close()
    m, halved = None, []
    while m is None:  # the engine and the plain loop side by side may not fit where the plain loop alone did
        cfg = config(ctx, preset, "bf16", mb, seq, 10_000)
        try:
            m = measure_speed(ctx, cfg, sampler)
        except oom_error():
            if mb <= candidates[0]:
                raise
            halved.append(f"{mb}: out of memory beside the plain loop")
            mb //= 2  # the candidates are powers of two
        free_device_memory(ctx.device)
    ctx.state[label] = {"preset": preset, "micro_batch": mb, "seq": seq, **m}
    tps = mb * seq / m["step_s"]
    peak = device_peak_tflops(device_name(ctx.device)) if ctx.device.type == "cuda" else None
    achieved = tps * flops_per_token(cfg.model, seq) / 1e12
    mfu = f"{achieved / peak:.1%} ({achieved:.0f} of {peak:.0f} TFLOP/s)" if peak else f"n/a ({achieved:.1f} TFLOP/s)"
    probed = ", ".join([f"{b}: {'OOM' if r is None else f'{r:,.0f}'}" for b, r in probes] + halved)
    ratio = m["plain_step_s"] / m["step_s"]
    return [
        row(
            f"{label} bf16 throughput",
            f"{tps:,.0f} tokens/s, {preset} micro-batch {mb} x {seq} (plain-loop probe tokens/s: {probed})",
            "fastest micro-batch that fits",
            None,
        ),
        row(f"{label} MFU", f"{mfu} on {device_name(ctx.device)}", "dense bf16 peak of the device", None),
        row(
            f"{label} foldtrain / plain PyTorch",
            f"{ratio:.3f} ({m['step_s'] * 1e3:.1f} vs {m['plain_step_s'] * 1e3:.1f} ms a step, {ctx.scale.reps} x "
            f"{ctx.scale.window} steps each, alternated)",
            ">= 0.97",
            ratio >= 0.97,
        ),
    ]


PAD = ("--model.vocab_multiple", "64")


def check_padding(ctx: Ctx) -> list[dict]:
    """``gpt2-small`` at its measured micro-batch with the vocabulary padded to a multiple of 64 (the head's
    products then have aligned leading dimensions): foldtrain's step against the unpadded one measured before,
    and the simulator's prediction on the calibrated cluster (the padded head's products are not in its table:
    they run on its fitted curve)."""
    from foldtrain.model.presets import padded_vocab
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.simulate import simulate

    label = next(iter(ctx.scale.speed))
    if label not in ctx.state:
        return [row("padded vocabulary", "no measured run (its throughput check failed)", "", False)]
    m, s = ctx.state[label], ctx.scale
    cfg = config(ctx, m["preset"], "bf16", m["micro_batch"], m["seq"], 10_000, PAD)
    engine = engine_for(cfg, ctx.device)
    _, times = engine_steps(engine, sampler_for(cfg), 0, s.warm + s.window * s.reps)
    step = statistics.median(times[s.warm :])
    rows_of_head = padded_vocab(cfg.model.vocab_size, int(PAD[1]))
    rows = [
        row(
            f"{label} padded vocabulary ({' '.join(PAD)})",
            f"{step * 1e3:.1f} ms a step against {m['step_s'] * 1e3:.1f} unpadded: {m['step_s'] / step:.2f}x "
            f"the tokens/s (vocabulary {cfg.model.vocab_size} padded to {rows_of_head})",
            "a figure",
            None,
        )
    ]
    cluster = ctx.state.get("cluster")
    if cluster:
        pred = simulate(cfg, load_cluster(cluster), check_memory=False).step_time
        rows.append(
            row(
                f"{label} padded vocabulary, simulated step (calibrated)",
                f"predicted {pred * 1e3:.1f} ms, measured {step * 1e3:.1f} ms ({pred / step - 1:+.1%})",
                "within 10%",
                abs(pred / step - 1) <= 0.10,
            )
        )
    return rows


def measured_runs(ctx: Ctx, what: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """The throughput checks' runs, and a FAIL row for each that is missing."""
    runs, missing = [], []
    for label in ctx.scale.speed:
        if label in ctx.state:
            runs.append((label, ctx.state[label]))
        else:
            missing.append(row(f"{label} {what}", "no measured run (its throughput check failed)", "", False))
    return runs, missing


def check_memory(ctx: Ctx) -> list[dict]:
    """The simulator's memory model of each measured run against its torch.cuda.max_memory_allocated."""
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.simulate import simulate

    runs, rows = measured_runs(ctx, "memory model")
    cluster = load_cluster("dgx-h100")
    for label, m in runs:
        cfg = config(ctx, m["preset"], "bf16", m["micro_batch"], m["seq"], 10_000)
        mem = simulate(cfg, cluster, check_memory=False).to_json()["memory_gb"][0]
        pred = (mem["total"] - mem.get("runtime", 0.0)) * GB  # the process's own overhead is not allocated
        err = pred / m["peak_bytes"] - 1
        rows.append(
            row(
                f"{label} memory model",
                f"predicted {pred / GB:.2f} GB (dgx-h100 model, runtime left out), "
                f"max_memory_allocated {m['peak_bytes'] / GB:.2f} GB ({err:+.1%})",
                "within 10%",
                abs(err) <= 0.10,
            )
        )
    return rows


def calibrate_args(ctx: Ctx) -> list[str]:
    """``foldtrain calibrate``'s arguments: the kernels of the measured runs' shapes (on the CPU in the dry mode,
    the per-operation probes' CPU twin)."""
    runs = [ctx.state[label] for label in ctx.scale.speed if label in ctx.state]
    presets = sorted({m["preset"] for m in runs}) or sorted({p for p, _ in ctx.scale.speed.values()})
    args = ["--device", "cpu", "--probes", "kernels"] if ctx.dry else ["--device", "cuda"]
    args += ["--preset", ",".join(presets), "--precision", "bf16", "--seq", str(ctx.scale.speed_seq)]
    if runs:
        args += ["--micro_batch", ",".join(str(b) for b in sorted({m["micro_batch"] for m in runs}))]
    return [*args, "--out", str(ctx.out / "cluster.toml")]


def check_calibrate(ctx: Ctx) -> list[dict]:
    """``foldtrain calibrate --device cuda`` through the command line, at the measured runs' shapes."""
    out = ctx.out / "cluster.toml"
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    rc, text = run_cmd([sys.executable, "-m", "foldtrain", "calibrate", *calibrate_args(ctx)], ctx.left() - 3)
    took = time.perf_counter() - t0
    ok = rc == 0 and out.is_file()
    if ok:
        ctx.state["cluster"] = str(out)
    status = "timed out" if rc is None else f"exit {rc}"
    what = f"{status} in {took:.0f} s" + (f", wrote {out.name}" if ok else f": {tail(text, 2)}")
    name = "foldtrain calibrate --device " + ("cpu --probes kernels" if ctx.dry else "cuda")
    return [row(name, what, "exit 0 and a cluster file", ok)]


def check_simulate(ctx: Ctx) -> list[dict]:
    """The simulator on the calibrated cluster file (what ``foldtrain simulate --cluster FILE`` prints) for each
    measured run, against its measured step time."""
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.simulate import simulate

    runs, rows = measured_runs(ctx, "simulated step")
    cluster = ctx.state.get("cluster")
    for label, m in runs:
        name = f"{label} simulated step (calibrated)"
        if not cluster:
            rows.append(row(name, "no cluster file (calibrate failed)", "within 10%", False))
            continue
        cfg = config(ctx, m["preset"], "bf16", m["micro_batch"], m["seq"], 10_000)
        pred, meas = simulate(cfg, load_cluster(cluster), check_memory=False).step_time, m["step_s"]
        rows.append(
            row(
                name,
                f"predicted {pred * 1e3:.1f} ms, measured {meas * 1e3:.1f} ms ({pred / meas - 1:+.1%})",
                "within 10%",
                abs(pred / meas - 1) <= 0.10,
            )
        )
    return rows
