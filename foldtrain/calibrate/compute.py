"""Compute probes: matrix products per dtype, products with few rows, memory bandwidth, a block's fixed cost,
blocks as a pipeline chunk runs them, the real fused head, the optimizer step; and the fits that turn them into
a cluster file's device numbers. Each probe runs in a child process; ``measure_compute`` runs several at once."""

from __future__ import annotations

import time

SIZES = (32, 64, 128, 256, 512)
DTYPES = ("fp32", "bf16", "fp16")


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
    import resource

    import torch

    import foldtrain.train.trainer  # noqa: F401 - what a training process imports, for its resident size
    from foldtrain.hostmem import keep_freed_host_memory

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
            t = _time(lambda: a @ b)  # noqa: B023 - _time calls it here, in this iteration
            rates.append(2 * 512 * n * 4 * n / t)
        out[name] = rates
    # few rows (a pipeline's micro-batch of few tokens) through a linear layer as the model has them
    # (weight [out, in], F.linear): (n x 256) @ (256 x 1024)
    linear = torch.nn.functional.linear
    rows = []
    narrow = torch.randn(1024, 256)
    for n in SIZES:
        a = torch.randn(n, 256)
        rows.append(2 * n * 256 * 1024 / _time(lambda: linear(a, narrow)))  # noqa: B023 - called in this iteration
    out["fp32_rows"] = rows
    x = torch.empty(16 * 2**20, dtype=torch.float32)
    y = torch.empty_like(x)
    out["mem_bw"] = 2 * x.numel() * 4 / _time(lambda: y.copy_(x))
    from foldtrain.model.gpt import Block, GPTShape

    blk = Block(GPTShape(1, 2, 16, 8, 16))
    h = torch.randn(1, 4, 16, requires_grad=True)
    out["block_overhead"] = _time(lambda: blk(h).sum().backward()) / 3  # forward + backward ~ 3 passes
    out["blocks"] = [_block_times(Block, GPTShape, *shape) for shape in RATIO_SHAPES]
    out["splits"] = [_block_times(Block, GPTShape, *shape, split=True) for shape in RATIO_SHAPES]
    out["heads"] = [_head_time(*shape) for shape in HEAD_SHAPES]
    # 4 M parameters: AdamW (fused, as the engines run it) and the norm for clipping
    w = torch.nn.Parameter(torch.randn(4 * 2**20))
    w.grad = torch.randn_like(w)
    adam = torch.optim.AdamW([w], fused=True)
    out["optim_rate"] = w.numel() / _time(lambda: (torch.nn.utils.clip_grad_norm_([w], 1.0), adam.step()))
    queue.put(out)


# (d_model, vocabulary, tokens): many tokens, and a micro-batch of few
HEAD_SHAPES = ((96, 8192, 2048), (256, 8192, 32))


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

    return Cluster(
        name="fit",
        gpus_per_node=1,
        memory=1e15,
        tflops={d: peak for d in DTYPES},
        mem_bw=1e30,
        efficiency=1.0,
        half_size=half,
        layer_overhead=overhead,
        intra=Link(1e9, 1e-6),
        inter=Link(1e9, 1e-6),
        rows_half_size=rows_half,
    )


def fit_head(peak: float, half: float, rows_half: float, times: list) -> tuple[float, float]:
    """What the fused head costs beyond the cost model's three matrix products, fitted to the real heads of
    ``HEAD_SHAPES``: ``residual = logits / softmax_rate + V d / head_weight_rate`` (the loss's log-softmax
    and the copies of the logits; streaming the weight and accumulating its gradient). Two shapes, two
    unknowns. Where the weight's term comes out at or below zero (on a CPU the log-softmax dominates, so the
    weight's share is within the probes' noise: one calibration's 2-process fit gave it -0.5 ms of 5.9), the
    per-logit term is fitted alone (``head_weight_rate`` 0: no weight term); ``(0, 0)``, the cost model's
    memory-bound defaults, only when no positive per-logit cost fits (which on a CPU put the head 54% slow)."""
    from foldtrain.config import build_config
    from foldtrain.sim.costs import CostModel
    from foldtrain.sim.setup import resolve_setup

    c = _fit_cluster(peak, half, 0.0, rows_half)
    rows = []
    for (d, vocab, tokens), t in zip(HEAD_SHAPES, times):
        cfg = build_config(
            [
                "--model.n_layer",
                "1",
                "--model.d_model",
                str(d),
                "--model.n_head",
                "4",
                "--model.vocab_size",
                str(vocab),
                "--model.context",
                str(tokens),
                "--train.seq_len",
                str(tokens),
                "--train.global_batch",
                "1",
            ]
        )
        cm = CostModel(resolve_setup(cfg), c)
        rows.append((tokens * vocab, vocab * d, t - cm.t_head_gemms))
    (a1, b1, r1), (a2, b2, r2) = rows
    det = a1 * b2 - a2 * b1
    per_logit, per_weight = (r1 * b2 - r2 * b1) / det, (a1 * r2 - a2 * r1) / det
    if per_logit > 0 and per_weight > 0:
        return 1 / per_logit, 1 / per_weight
    alone = (a1 * r1 + a2 * r2) / (a1 * a1 + a2 * a2)  # least squares, the logits' term only
    return (1 / alone, 0.0) if alone > 0 else (0.0, 0.0)


# (d_model, heads, batch, seq): a block of tiny's width, wider ones with few tokens (a micro-batch)
RATIO_SHAPES = ((96, 4, 4, 128), (256, 4, 1, 64), (256, 4, 1, 32))


def _block_times(
    Block,
    GPTShape,
    d: int,
    heads: int,
    b: int,
    seq: int,
    n_blocks: int = 4,
    in_flight: int = 4,
    min_s: float = 0.3,
    split: bool = False,
) -> tuple[float, float]:
    """Forward (with autograd recording, as in training) and backward time of one block and micro-batch,
    timed as a pipeline chunk runs them: ``in_flight`` micro-batches forward through ``n_blocks``
    distinct blocks, their graphs held, then backward in reverse order; so each block's weights come
    from beyond the core's private cache as in a run (a lone block timed in a loop stays in it and
    ran 25-35% faster here). Median of repetitions. ``split``: the zero-bubble schedules' backward in
    two (:mod:`foldtrain.parallel.pipeline.split_backward`), ``(I, W)`` times instead."""
    import torch

    from foldtrain.parallel.pipeline.split_backward import backward_input, backward_weight, split_for

    blks = torch.nn.Sequential(*[Block(GPTShape(1, heads, d, seq, 16)) for _ in range(n_blocks)])
    xs = [torch.randn(b, seq, d, requires_grad=True) for _ in range(in_flight)]
    grads = [torch.randn(b, seq, d) for _ in range(in_flight)]
    halves = split_for(blks, recomputed=False) if split else None  # its hooks stay off the whole backward's timing

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        outs = [halves.forward(blks, x) if split else (blks(x), None) for x in xs]
        t1 = time.perf_counter()
        work = []
        for (y, notes), x, g in zip(reversed(outs), reversed(xs), reversed(grads)):
            if split:
                work.append(backward_input(halves, [y], [g], x, notes))
            else:
                torch.autograd.backward(y, g)
        t2 = time.perf_counter()
        for w in work:
            backward_weight(halves, w)
        t3 = time.perf_counter()
        n = n_blocks * in_flight
        return ((t2 - t1) / n, (t3 - t2) / n) if split else ((t1 - t0) / n, (t2 - t1) / n)

    once()
    runs, t_end = [], time.perf_counter() + min_s
    while len(runs) < 5 or time.perf_counter() < t_end:
        runs.append(once())
    first = sorted(r[0] for r in runs)[len(runs) // 2]
    second = sorted(r[1] for r in runs)[len(runs) // 2]
    return (first, second) if split else (first, max(second, 0.1 * first))


def _oversubscription_probe(barrier, queue) -> None:
    import torch

    from foldtrain.hostmem import keep_freed_host_memory
    from foldtrain.model.gpt import Block, GPTShape

    torch.set_num_threads(1)
    keep_freed_host_memory()
    _block_times(Block, GPTShape, *RATIO_SHAPES[0], min_s=0.05)  # warm up
    barrier.wait()
    queue.put([sum(_block_times(Block, GPTShape, *shape, min_s=1.0)) for shape in RATIO_SHAPES])


def _concurrently(probe, concurrency: int) -> list:
    """Run ``probe(barrier, queue)`` in ``concurrency`` fresh processes that start measuring together;
    what each put on the queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(concurrency), ctx.Queue()
    procs = [ctx.Process(target=probe, args=(barrier, queue)) for _ in range(concurrency)]
    for p in procs:
        p.start()
    res = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return res


def _blocks_at(concurrency: int) -> list[float]:
    """Forward + backward time of a block per ``RATIO_SHAPES``, mean over ``concurrency`` processes at once."""
    res = _concurrently(_oversubscription_probe, concurrency)
    return [sum(r[i] for r in res) / len(res) for i in range(len(RATIO_SHAPES))]


def measure_oversubscription(ranks: int, cores: int, rounds: int = 2) -> tuple[float, list[float]]:
    """Share of the cores' work done when ``ranks`` > ``cores`` single-threaded processes compute at once:
    blocks timed with ``cores`` processes (one core each) and with ``ranks`` (a fair share would make each
    ``ranks / cores`` times slower), alternated ``rounds`` times; the median ratio, at most 1, and all of
    them. The simulator applies the loss from ``2 * cores`` busy ranks on and linearly less below
    (``node.oversubscribed_efficiency``): a ratio measured at fewer ranks is scaled to that point."""
    if ranks <= cores:
        return 1.0, []
    ratios: list[float] = []
    for _ in range(rounds):
        base, over = _blocks_at(cores), _blocks_at(ranks)
        ratios += [b * ranks / cores / o for b, o in zip(base, over)]
    ratios.sort()
    measured = min(1.0, ratios[len(ratios) // 2])
    return max(0.05, 1.0 - (1.0 - measured) / min(1.0, (ranks - cores) / cores)), ratios


def fit_elem_bw(peak: float, half: float, overhead: float, blocks: list, rows_half: float = 0.0) -> float:
    """The element-wise bandwidth that makes the cost model's block forward (:mod:`foldtrain.sim.costs`)
    equal the measured ones: their time beyond the matrix products and the fixed cost, over the
    element-wise bytes the model counts (mean over ``RATIO_SHAPES``); 0 when nothing is left."""
    from foldtrain.config import build_config
    from foldtrain.sim import ops
    from foldtrain.sim.costs import CostModel
    from foldtrain.sim.setup import resolve_setup

    c = _fit_cluster(peak, half, overhead, rows_half)
    fits = []
    for (d, heads, b, seq), (fwd, _) in zip(RATIO_SHAPES, blocks):
        cfg = build_config(
            [
                "--model.n_layer",
                "1",
                "--model.d_model",
                str(d),
                "--model.n_head",
                str(heads),
                "--model.context",
                str(seq),
                "--model.vocab_size",
                "64",
                "--train.seq_len",
                str(seq),
                "--train.global_batch",
                str(b),
            ]
        )
        cm = CostModel(resolve_setup(cfg), c)
        left = fwd - cm.t_block_f
        if left > 0:
            fits.append(cm.memory_bytes(ops.block_forward(cm.priced)) / left)
    return sum(fits) / len(fits) if fits else 0.0


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
    res = _concurrently(_compute_probe, concurrency)
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
    splits = [[sum(r["splits"][i][j] for r in res) / len(res) for j in (0, 1)] for i in range(len(RATIO_SHAPES))]
    # the split backward (I + W) against the whole one, and W's share of it
    out["split_ratio"] = sum((i + w) / b for (i, w), (_f, b) in zip(splits, blocks)) / len(blocks)
    out["split_weight_share"] = sum(w / (i + w) for i, w in splits) / len(splits)
    out["elem_bw"] = fit_elem_bw(out["fp32"][0], out["fp32"][1], out["block_overhead"], blocks, out["rows_half_size"])
    heads = [sum(r["heads"][i] for r in res) / len(res) for i in range(len(HEAD_SHAPES))]
    out["softmax_rate"], out["head_weight_rate"] = fit_head(
        out["fp32"][0], out["fp32"][1], out["rows_half_size"], heads
    )
    out["heads"] = heads
    out["blocks"] = blocks
    out["runtime"] = max(r["runtime"] for r in res)
    return out
