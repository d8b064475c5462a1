"""``foldtrain calibrate --out FILE [--network RATE --nodes N --ranks_per_node R]``: measure this machine.

Writes a cluster file (:mod:`foldtrain.sim.cluster`) for ``foldtrain simulate --cluster FILE``:

* compute: matrix products ``(512 x n) @ (n x 4n)`` for ``n`` in 32..512 per dtype, run by
  ``min(N x R, cores)`` processes at once (each on a core of its own, as busy as the runs'
  ranks; ``node.shared_cores`` tells the simulator that more ranks than cores share them), fitted to
  ``rate(n) = peak * n / (n + half_size)``; memory bandwidth from a 64 MB copy, the fixed
  cost of a transformer block from a tiny one, a real block's backward / forward time ratio (2 by FLOPs;
  blocks timed as a pipeline chunk runs them: several distinct ones, several micro-batches in flight),
  the element-wise bandwidth that makes the cost model's block forward equal a
  real one (on a CPU, exp/erf/tanh bind it, not memory), and what the real fused head costs beyond its
  matrix products, per logit (log-softmax, copies) and per weight element (streaming it, accumulating
  its gradient), fitted at two shapes, the optimizer step per parameter (fused AdamW and the
  clipping norm: on a CPU compute-bound, not memory-bound), under
  the same concurrency; the loss's ``(b, L, V)`` buffers the resident peak holds (real training
  steps at two token counts: the host allocator's holes included);
* communication: gloo point-to-point latency (ping-pong), and all-reduce bandwidth (and the CPU
  time per byte sent its threads take, which on shared cores comes out of compute) over the
  ``R`` ranks of one node (``torchrun --standalone``): the ``intra`` link;
* the pipeline executor's own host work per action (``device.action_overhead_us``): a real 2-rank
  pipeline of a negligible model, its step against the simulator's without it;
* with ``--network RATE``: the same over ``N`` emulated nodes on throttled links
  (:mod:`foldtrain.netem`, one rank per node): the ``inter`` link. Needs root and iproute2.

Above :mod:`foldtrain.sim` (it imports torch and the benchmark's namespaces); the simulator
itself stays pure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

from foldtrain.errors import FoldtrainError

SIZES = (32, 64, 128, 256, 512)
DTYPES = ("fp32", "bf16", "fp16")


# --------------------------------------------------------------------------- probes (child processes)


def _time(fn, min_s: float = 0.15, reps: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        best = min(best, dt / n)
    return best


def _micro_step() -> None:
    """Three training steps of a negligible model (forward, backward, fused AdamW): what autograd,
    the optimizer kernels and the allocator add to a process's resident size the first time."""
    import torch

    from foldtrain.model.gpt import GPT, GPTShape

    m = GPT(GPTShape(1, 2, 16, 32, 64))
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    x = torch.randint(0, 64, (2, 32))
    for _ in range(3):
        m(x).float().mean().backward()
        opt.step()


def _compute_probe(barrier, queue) -> None:
    import torch

    import resource

    import foldtrain.train.trainer  # noqa: F401 - what a training process imports, for its resident size
    from foldtrain.distributed import keep_freed_host_memory

    torch.set_num_threads(1)
    keep_freed_host_memory()  # as a CPU training process does (--train.malloc_cache)
    _micro_step()
    out: dict = {"runtime": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    barrier.wait()
    for name in DTYPES:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        rates: list[float] = []
        for n in SIZES:
            if rates and 2 * 512 * n * 4 * n / rates[-1] > 1.0:  # a call would take > 1 s (no fast kernel): extrapolate
                rates.append(rates[-1])
                continue
            a = torch.randn(512, n, dtype=dt)
            b = torch.randn(n, 4 * n, dtype=dt)
            t = _time(lambda: a @ b)
            rates.append(2 * 512 * n * 4 * n / t)
        out[name] = rates
    # few rows (a pipeline's micro-batch of few tokens) through a linear layer as the model has them
    # (weight [out, in], F.linear): (n x 256) @ (256 x 1024)
    linear = torch.nn.functional.linear
    rows = []
    narrow = torch.randn(1024, 256)
    for n in SIZES:
        a = torch.randn(n, 256)
        rows.append(2 * n * 256 * 1024 / _time(lambda: linear(a, narrow)))
    out["fp32_rows"] = rows
    x = torch.empty(16 * 2**20, dtype=torch.float32)
    y = torch.empty_like(x)
    out["mem_bw"] = 2 * x.numel() * 4 / _time(lambda: y.copy_(x))
    from foldtrain.model.gpt import Block, GPTShape

    blk = Block(GPTShape(1, 2, 16, 8, 16))
    h = torch.randn(1, 4, 16, requires_grad=True)
    out["block_overhead"] = _time(lambda: blk(h).sum().backward()) / 3  # forward + backward ~ 3 passes
    out["blocks"] = [_block_times(Block, GPTShape, *shape) for shape in RATIO_SHAPES]
    out["heads"] = [_head_time(*shape) for shape in HEAD_SHAPES]
    w = torch.nn.Parameter(torch.randn(4 * 2**20))  # 4 M parameters: AdamW (fused, as the engines run it) and the norm for clipping
    w.grad = torch.randn_like(w)
    adam = torch.optim.AdamW([w], fused=True)
    out["optim_rate"] = w.numel() / _time(lambda: (torch.nn.utils.clip_grad_norm_([w], 1.0), adam.step()))
    queue.put(out)


HEAD_SHAPES = ((96, 8192, 2048), (256, 8192, 32))  # (d_model, vocabulary, tokens): many tokens, and a micro-batch of few


def _head_time(d: int, vocab: int, tokens: int) -> float:
    """The real fused head (final norm, output projection, fp32 cross-entropy) forward and backward, as the
    last stage runs it, with the weight's gradient accumulated as in training."""
    import torch

    from foldtrain.model.gpt import GPTShape, Head, lm_loss

    head = Head(GPTShape(1, 4, d, tokens, vocab))
    x = torch.randn(1, tokens, d, requires_grad=True)
    target = torch.randint(0, vocab, (1, tokens))
    return _time(lambda: lm_loss(head(x), target).backward(), min_s=0.2, reps=3)


def _fit_cluster(peak: float = 1e12, half: float = 1.0, overhead: float = 0.0, rows_half: float = 0.0):
    """A one-device cluster with only the compute numbers a fit needs (memory and links never bind)."""
    from foldtrain.sim.cluster import Cluster, Link

    return Cluster(name="fit", gpus_per_node=1, memory=1e15, tflops={d: peak for d in DTYPES}, mem_bw=1e30, efficiency=1.0,
                   half_size=half, layer_overhead=overhead, intra=Link(1e9, 1e-6), inter=Link(1e9, 1e-6), rows_half_size=rows_half)


def fit_head(peak: float, half: float, rows_half: float, times: list) -> tuple[float, float]:
    """What the fused head costs beyond the cost model's three matrix products, fitted to the real heads of
    ``HEAD_SHAPES``: ``residual = logits / softmax_rate + V d / head_weight_rate`` (the loss's log-softmax
    and the copies of the logits; streaming the weight and accumulating its gradient). Two shapes, two
    unknowns; ``(0, 0)`` (the cost model's defaults) when the fit is not positive."""
    from foldtrain.config import build_config
    from foldtrain.sim.costs import CostModel
    from foldtrain.sim.setup import resolve_setup

    c = _fit_cluster(peak, half, 0.0, rows_half)
    rows = []
    for (d, vocab, tokens), t in zip(HEAD_SHAPES, times):
        cfg = build_config(["--model.n_layer", "1", "--model.d_model", str(d), "--model.n_head", "4", "--model.vocab_size", str(vocab),
                            "--model.context", str(tokens), "--train.seq_len", str(tokens), "--train.global_batch", "1"])
        cm = CostModel(resolve_setup(cfg), c)
        rows.append((tokens * vocab, vocab * d, t - 3 * cm.t_head_f))
    (a1, b1, r1), (a2, b2, r2) = rows
    det = a1 * b2 - a2 * b1
    per_logit, per_weight = (r1 * b2 - r2 * b1) / det, (a1 * r2 - a2 * r1) / det
    if per_logit <= 0 or per_weight <= 0:
        return 0.0, 0.0
    return 1 / per_logit, 1 / per_weight


RATIO_SHAPES = ((96, 4, 4, 128), (256, 4, 1, 64), (256, 4, 1, 32))  # (d_model, heads, batch, seq): a block of tiny's width, wider ones with few tokens (a micro-batch)


def _block_times(Block, GPTShape, d: int, heads: int, b: int, seq: int, n_blocks: int = 4, in_flight: int = 4) -> tuple[float, float]:
    """Forward (with autograd recording, as in training) and backward time of one block and micro-batch,
    timed as a pipeline chunk runs them: ``in_flight`` micro-batches forward through ``n_blocks``
    distinct blocks, their graphs held, then backward in reverse order; so each block's weights come
    from beyond the core's private cache as in a run (a lone block timed in a loop stays in it and
    ran 25-35% faster here). Median of repetitions."""
    import torch

    blks = [Block(GPTShape(1, heads, d, seq, 16)) for _ in range(n_blocks)]
    xs = [torch.randn(b, seq, d, requires_grad=True) for _ in range(in_flight)]
    grads = [torch.randn(b, seq, d) for _ in range(in_flight)]

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        outs = []
        for x in xs:
            for blk in blks:
                x = blk(x)
            outs.append(x)
        t1 = time.perf_counter()
        for y, g in zip(reversed(outs), reversed(grads)):
            torch.autograd.backward(y, g)
        t2 = time.perf_counter()
        n = n_blocks * in_flight
        return (t1 - t0) / n, (t2 - t1) / n

    once()
    runs, t_end = [], time.perf_counter() + 0.3
    while len(runs) < 5 or time.perf_counter() < t_end:
        runs.append(once())
    fwd = sorted(r[0] for r in runs)[len(runs) // 2]
    bwd = sorted(r[1] for r in runs)[len(runs) // 2]
    return fwd, max(bwd, 0.1 * fwd)


LOSS_SHAPE = dict(n_layer=2, n_head=4, d_model=96, context=128, vocab_size=8192)  # tiny's width and vocabulary
LOSS_TOKENS = (512, 2048)
REPEATS = 2


def _loss_probe(tokens: int, queue) -> None:
    """Peak resident size of 16 real training steps (forward, loss, backward, fused AdamW) at ``tokens``
    tokens per step, with the host allocator set up as a CPU training process sets it."""
    import resource

    import torch

    from foldtrain.distributed import keep_freed_host_memory
    from foldtrain.model.gpt import GPT, GPTShape, lm_loss

    torch.set_num_threads(1)
    keep_freed_host_memory()
    sh = LOSS_SHAPE
    m = GPT(GPTShape(sh["n_layer"], sh["n_head"], sh["d_model"], sh["context"], sh["vocab_size"]))
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    x = torch.randint(0, sh["vocab_size"], (tokens // sh["context"], sh["context"]))
    for _ in range(16):
        lm_loss(m(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def measure_loss_buffers() -> float:
    """How many fp32 ``(b, L, V)`` tensors the resident peak holds per token beyond the activations the cost
    model counts: the slope of the peak resident size of real training steps between two token counts
    (fresh processes, twice), less the model's activation bytes per token, over ``V * 4``. 3 are live at the
    loss's backward; a host allocator that keeps freed blocks shows more."""
    import multiprocessing as mp

    from foldtrain.config import build_config
    from foldtrain.sim.costs import CostModel
    from foldtrain.sim.setup import resolve_setup

    ctx = mp.get_context("spawn")
    peaks = [0.0, 0.0]
    for _ in range(REPEATS):  # where holes form depends on the order of events: average a few processes
        for i, tokens in enumerate(LOSS_TOKENS):
            q = ctx.Queue()
            p = ctx.Process(target=_loss_probe, args=(tokens, q))
            p.start()
            peaks[i] += q.get(timeout=600) / REPEATS
            p.join()
    sh = LOSS_SHAPE
    cfg = build_config(["--model.n_layer", str(sh["n_layer"]), "--model.n_head", str(sh["n_head"]), "--model.d_model", str(sh["d_model"]),
                        "--model.context", str(sh["context"]), "--model.vocab_size", str(sh["vocab_size"]),
                        "--train.seq_len", str(sh["context"]), "--train.global_batch", "1"])
    cm = CostModel(resolve_setup(cfg), _fit_cluster())  # only its activation sizes are read
    act_per_token = (sh["n_layer"] * cm.act_bytes_block(recompute=False) + cm.activation_bytes()) / sh["context"]
    slope = (peaks[1] - peaks[0]) / (LOSS_TOKENS[1] - LOSS_TOKENS[0])
    return max((slope - act_per_token) / (sh["vocab_size"] * 4), 1.0)


def fit_elem_bw(peak: float, half: float, overhead: float, blocks: list, rows_half: float = 0.0) -> float:
    """The element-wise bandwidth that makes the cost model's block forward (:mod:`foldtrain.sim.costs`)
    equal the measured ones: their time beyond the matrix products and the fixed cost, over the
    element-wise bytes the model counts (mean over ``RATIO_SHAPES``); 0 when nothing is left."""
    from foldtrain.config import build_config
    from foldtrain.sim.costs import CostModel
    from foldtrain.sim.setup import resolve_setup

    c = _fit_cluster(peak, half, overhead, rows_half)
    fits = []
    for (d, heads, b, seq), (fwd, _) in zip(RATIO_SHAPES, blocks):
        cfg = build_config(["--model.n_layer", "1", "--model.d_model", str(d), "--model.n_head", str(heads), "--model.context", str(seq),
                            "--model.vocab_size", "64", "--train.seq_len", str(seq), "--train.global_batch", str(b)])
        cm = CostModel(resolve_setup(cfg), c)
        left = fwd - cm.t_block_f
        if left > 0:
            fits.append(2 * cm.act_bytes_block(recompute=False) / left)
    return sum(fits) / len(fits) if fits else 0.0


def _comm_probe() -> None:
    """Run under torchrun: prints one JSON line on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    one = torch.zeros(1)
    lat = []
    for i in range(40):
        dist.barrier() if i == 0 else None
        t0 = time.perf_counter()
        if r == 0:
            dist.send(one, 1)
            dist.recv(one, 1)
        elif r == 1:
            dist.recv(one, 0)
            dist.send(one, 0)
        lat.append((time.perf_counter() - t0) / 2)
    big = torch.zeros(4 * 2**20)  # 16 MB
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        if r == 0:
            dist.send(big, 1)
        elif r == 1:
            dist.recv(big, 0)
    dist.barrier()
    p2p = 3 * big.numel() * 4 / (time.perf_counter() - t0)
    dist.all_reduce(big)
    dist.barrier()
    import resource

    def cpu() -> float:  # this process's CPU time, every thread (gloo's included)
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    for _ in range(3):
        dist.all_reduce(big)
    ar_t = (time.perf_counter() - t0) / 3
    sent = 2 * (w - 1) / w * big.numel() * 4
    cpu_per_byte = (cpu() - c0) / (3 * sent)
    ar_bw = sent / ar_t
    if r == 0:
        lat.sort()
        print("CALIBRATE " + json.dumps({"latency_s": lat[len(lat) // 2], "p2p_bw": p2p, "allreduce_bw": ar_bw, "world": w,
                                         "cpu_per_byte": cpu_per_byte}), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- fitting and running


def fit_half_size(peak: float, sizes, rates) -> float:
    """Least squares of ``peak / rate - 1 = h / n`` at a given peak: the ``h`` of ``rate = peak n / (n + h)``."""
    num = sum((peak / r - 1) / n for n, r in zip(sizes, rates))
    den = sum(1 / n**2 for n in sizes)
    return max(num / den, 1e-3)


def fit_rate(sizes, rates) -> tuple[float, float]:
    """Least squares of ``1/rate = 1/A + h/(A n)``: returns ``(A, h)`` (``rate = A n / (n + h)``)."""
    xs = [1.0 / n for n in sizes]
    ys = [1.0 / r for r in rates]
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    icpt = my - slope * mx
    if icpt <= 0:  # rate still rising at the largest size: take the best measured as the peak
        return max(rates), 1e-3
    a = 1.0 / icpt
    return a, max(slope * a, 1e-3)


def measure_compute(concurrency: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(concurrency), ctx.Queue()
    procs = [ctx.Process(target=_compute_probe, args=(barrier, queue)) for _ in range(concurrency)]
    for p in procs:
        p.start()
    res = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    out = {}
    for name in DTYPES:
        rates = [sum(r[name][i] for r in res) / len(res) for i in range(len(SIZES))]
        out[name] = fit_rate(SIZES, rates) + (rates,)
    out["fp32_rows"] = [sum(r["fp32_rows"][i] for r in res) / len(res) for i in range(len(SIZES))]
    out["rows_half_size"] = fit_half_size(out["fp32"][0], SIZES, out["fp32_rows"])
    out["mem_bw"] = sum(r["mem_bw"] for r in res) / len(res)
    out["block_overhead"] = sum(r["block_overhead"] for r in res) / len(res)
    out["optim_rate"] = sum(r["optim_rate"] for r in res) / len(res)
    blocks = [[sum(r["blocks"][i][j] for r in res) / len(res) for j in (0, 1)] for i in range(len(RATIO_SHAPES))]
    out["backward_ratio"] = sum(b / f for f, b in blocks) / len(blocks)
    out["elem_bw"] = fit_elem_bw(out["fp32"][0], out["fp32"][1], out["block_overhead"], blocks, out["rows_half_size"])
    heads = [sum(r["heads"][i] for r in res) / len(res) for i in range(len(HEAD_SHAPES))]
    out["softmax_rate"], out["head_weight_rate"] = fit_head(out["fp32"][0], out["fp32"][1], out["rows_half_size"], heads)
    out["heads"] = heads
    out["blocks"] = blocks
    out["runtime"] = max(r["runtime"] for r in res)
    return out


def _parse(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("CALIBRATE "):
            return json.loads(line[len("CALIBRATE "):])
    raise FoldtrainError(f"calibrate: the communication probe printed no result; its output ends with: {text[-300:]!r}")


def measure_loopback(ranks: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(max(ranks, 2)),
           "-m", "foldtrain.calibrate", "--_comm_probe"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0:
        raise FoldtrainError(f"calibrate: the loopback communication probe failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return _parse(p.stdout)


def measure_network(rate: str, nodes: int) -> dict:
    from foldtrain.netem.cluster import EmulatedCluster

    with EmulatedCluster(nodes, rate, name_prefix="ftcal") as c:
        log = tempfile.mkdtemp(prefix="ft-cal-")
        job = c.run_torchrun(["-m", "foldtrain.calibrate", "--_comm_probe"], nproc_per_node=1, timeout_s=300, log_dir=log)
        if not job.ok:
            raise FoldtrainError(f"calibrate: the communication probe across emulated nodes failed (logs in {log})")
        return _parse(job.text())


EXECUTOR_PROBE = ["--model.preset", "tiny", "--model.n_layer", "4", "--model.d_model", "16", "--model.n_head", "2",
                  "--train.seq_len", "8", "--train.global_batch", "16", "--parallel.pp", "2", "--parallel.virtual", "2",
                  "--parallel.microbatches", "16", "--parallel.schedule", "interleaved-1f1b"]
EXECUTOR_STEPS = 16


def measure_action_overhead(cluster) -> tuple[float, float, float]:
    """The pipeline executor's own host work per action: a real 2-rank pipeline (``foldtrain train``,
    ``torchrun --standalone``) of a negligible model with 16 micro-batches, so that its step is nearly all
    executor (bookkeeping, posting and waiting for transfers, waking up), against the simulator's step of
    the same run on ``cluster`` without it, per action of a rank's list. Returns ``(overhead_s,
    measured_step_s, simulated_step_s)``."""
    import dataclasses
    import shutil
    import statistics

    from foldtrain.config import build_config
    from foldtrain.data import resolve_data
    from foldtrain.schedules import build_schedule
    from foldtrain.sim.simulate import simulate

    cfg = build_config(EXECUTOR_PROBE)
    data = str(resolve_data(cfg.data))  # the built-in corpus (prepared once, then cached)
    out = tempfile.mkdtemp(prefix="ft-cal-exec-")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "foldtrain", "train",
           *EXECUTOR_PROBE, "--data.path", data, "--train.steps", str(EXECUTOR_STEPS), "--train.eval_every", "0",
           "--train.log_every", "1", "--out", out]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if p.returncode != 0:
            raise FoldtrainError("calibrate: the pipeline executor probe failed: "
                                 f"{((p.stderr or p.stdout).strip().splitlines() or [''])[-1]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > EXECUTOR_STEPS // 3]
    measured = statistics.median(steps)
    bare = dataclasses.replace(cluster, action_overhead=0.0, memory=1e12)
    simulated = simulate(build_config([*EXECUTOR_PROBE, "--data.path", data]), bare).step_time
    sched = build_schedule("interleaved-1f1b", 2, 2, 16)
    actions = max(len(acts) for acts in sched.ranks)
    return max(0.0, (measured - simulated) / actions), measured, simulated


def check_network_prerequisites() -> None:
    from foldtrain.netem import cluster as netns

    try:
        netns.check_prerequisites()
    except FoldtrainError:
        raise FoldtrainError(
            "calibrate --network emulates nodes with network namespaces and needs root and iproute2 (ip, tc): "
            "run as root and `apt-get install -y iproute2`, or drop --network to measure this machine only"
        ) from None


def main(argv: list[str]) -> int:
    if argv == ["--_comm_probe"]:
        _comm_probe()
        return 0
    ap = argparse.ArgumentParser(prog="foldtrain calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="cluster TOML file to write")
    ap.add_argument("--network", help="emulated link rate between nodes, e.g. 1gbit (needs root and iproute2)")
    ap.add_argument("--nodes", type=int, default=1, help="emulated nodes (with --network)")
    ap.add_argument("--ranks_per_node", type=int, default=2, help="ranks per node the runs will have")
    ap.add_argument("--name", default="", help="cluster name (default: the file's stem)")
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.ranks_per_node < 1:
        raise FoldtrainError(f"--nodes and --ranks_per_node must be >= 1, got {a.nodes} and {a.ranks_per_node}")
    if a.network:
        if a.nodes < 2:
            raise FoldtrainError("calibrate --network needs --nodes 2 or more to measure a link between nodes")
        check_network_prerequisites()
    from foldtrain.sim.cluster import Cluster, Link, to_toml

    ranks = a.nodes * a.ranks_per_node
    cores = os.cpu_count() or 1
    conc = min(ranks, cores)  # each process on a core of its own; the simulator shares the cores among more ranks
    print(f"calibrate: compute with {conc} concurrent processes ...", flush=True)
    comp = measure_compute(conc)
    print("calibrate: memory at the loss ...", flush=True)
    loss_buffers = measure_loss_buffers()
    print("calibrate: gloo on loopback ...", flush=True)
    loop = measure_loopback(a.ranks_per_node)
    net = None
    if a.network:
        print(f"calibrate: gloo across {a.nodes} emulated nodes at {a.network} ...", flush=True)
        net = measure_network(a.network, a.nodes)
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    import dataclasses

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fp32_a, fp32_h, _ = comp["fp32"]
    intra = Link(loop["allreduce_bw"], loop["latency_s"])
    inter = Link(net["allreduce_bw"], net["latency_s"]) if net else intra
    name = a.name or os.path.splitext(os.path.basename(a.out))[0]
    c = Cluster(name=name, gpus_per_node=a.ranks_per_node, memory=total / ranks, shared_cores=float(cores),
                tflops={d: comp[d][0] for d in DTYPES}, mem_bw=comp["mem_bw"], efficiency=1.0, half_size=fp32_h,
                layer_overhead=comp["block_overhead"], intra=intra, inter=inter, runtime=comp["runtime"],
                backward_ratio=comp["backward_ratio"], elem_bw=comp["elem_bw"], softmax_rate=comp["softmax_rate"],
                loss_buffers=loss_buffers, rows_half_size=comp["rows_half_size"], head_weight_rate=comp["head_weight_rate"],
                optim_rate=comp["optim_rate"], comm_cpu=(net or loop).get("cpu_per_byte", 0.0))
    print("calibrate: the pipeline executor's own work per action ...", flush=True)
    ov, ov_measured, ov_sim = measure_action_overhead(
        dataclasses.replace(c, gpus_per_node=2, intra=Link(loop["allreduce_bw"], loop["latency_s"])))
    c = dataclasses.replace(c, action_overhead=ov)
    src = f"foldtrain calibrate, {when}, {conc} concurrent processes"
    notes = {f"device.{d}_tflops": f"{src}: fitted peak of (512 x n) @ (n x 4n), n = {SIZES}; measured "
             + ", ".join(f"{r / 1e9:.1f}" for r in comp[d][2]) + " GFLOP/s" for d in DTYPES}
    notes.update({
        "node.gpus": f"--ranks_per_node ({src})",
        "node.shared_cores": "os.cpu_count(): every emulated node's ranks run on this machine's cores",
        "node.comm_cpu_ns": f"{src}: CPU time of a rank (all threads) over the bytes it sends in the "
                            + ("emulated nodes'" if net else "loopback") + " all-reduce",
        "device.memory_gb": "MemTotal / ranks (nodes x ranks_per_node)",
        "device.mem_bw_gbs": f"{src}: 64 MB copy",
        "device.efficiency": "folded into the fitted peaks",
        "device.half_size": f"{src}: fp32 fit (the half-precision fits give " + ", ".join(f"{comp[d][1]:.0f}" for d in ("bf16", "fp16")) + ")",
        "device.layer_overhead_us": f"{src}: forward + backward of a tiny block / 3",
        "device.backward_ratio": f"{src}: backward / forward time of a block, mean over (d, heads, batch, seq) = {RATIO_SHAPES}",
        "device.elem_gbs": f"{src}: fitted so that the cost model's block forward equals the measured one at {RATIO_SHAPES}",
        "device.softmax_gelems": f"{src}: per logit, fitted with head_weight_gelems to the real fused head (norm, projection, "
                                 f"fp32 cross-entropy, forward + backward) at (d, V, tokens) = {HEAD_SHAPES} beyond its matrix products",
        "device.head_weight_gelems": f"{src}: per element of the head's weight, the same fit",
        "device.action_overhead_us": f"{src}: a 2-rank pipeline of a negligible model (interleaved-1f1b, V 2, 16 micro-batches) "
                                     f"took {ov_measured * 1e3:.1f} ms a step, the simulator without it {ov_sim * 1e3:.1f} ms; "
                                     "the difference per action of a rank's list",
        "device.optim_gparams": f"{src}: fused AdamW step and gradient-norm clipping of 4 M fp32 parameters",
        "device.rows_half_size": f"{src}: fp32 F.linear of (n x 256) with a 1024 x 256 weight, n = {SIZES}, at the fitted fp32 peak; measured "
                                 + ", ".join(f"{r / 1e9:.1f}" for r in comp["fp32_rows"]) + " GFLOP/s",
        "device.loss_buffers": f"{src}: peak resident size of 16 training steps at {LOSS_TOKENS} tokens of a {LOSS_SHAPE} GPT, per "
                               "token, less the activations the cost model counts, over 4 V bytes",
        "device.runtime_gb": f"{src}: resident size of a process that imported the trainer and ran 3 steps of a negligible model",
        "intra.bw_gbs": f"{src}: gloo all-reduce of 16 MB over {max(a.ranks_per_node, 2)} local ranks (p2p {loop['p2p_bw'] / 1e9:.2f} GB/s)",
        "intra.latency_us": f"{src}: gloo ping-pong / 2",
        "inter.bw_gbs": (f"{src}: gloo all-reduce over {a.nodes} emulated nodes at {a.network} (p2p {net['p2p_bw'] / 1e9:.3f} GB/s)"
                         if net else "no --network: same as intra"),
        "inter.latency_us": f"{src}: ping-pong across emulated nodes" if net else "no --network: same as intra",
    })
    text = f"# measured by foldtrain calibrate {' '.join(argv)}\n" + to_toml(c, notes)
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
