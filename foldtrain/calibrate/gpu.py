"""The kernel probes of ``foldtrain calibrate --device cuda``, device-generic: each takes a ``torch.device`` and
its sizes, so that on a CPU they run as the tests' twin.

What each measures is what :mod:`foldtrain.sim.ops` prices: matrix products at their ``(M, N, K)``, fused
attention (SDPA) at ``(batch, heads, seq, head_dim)`` with FLOPs counted as ops counts them, the memory-bound
kernels by the bytes ops counts over their time (each run as foldtrain's model runs it: autocast over fp32
weights for the half precisions), the fused AdamW step, a copy and an add, the host time of an eager kernel
launch, a real block's backward / forward ratio and the host work of a block beyond its launches, and the
memory the framework takes beyond its tensors. The CUDA-only lines are in :func:`sync`, :func:`device_time`
and :func:`memory_overhead`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import time

from foldtrain.sim import ops

from .compute import fit_rate

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# calls a device timing queues behind one sleep kernel (a few kernels each: well inside the launch queue)
MAX_QUEUED = 32
SLEEP_CYCLES = 50_000_000  # 25-35 ms of a GPU's clock: longer than the host takes to queue MAX_QUEUED calls

# Dense peak TFLOP/s (no sparsity) by device name, first match wins; a dtype left out is measured (the best
# rate of any product). Sources: NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5 989.4 bf16/fp16,
# 66.9 fp32; H100 PCIe 756.5, 51.2; H200 and GH200 have the H100 SXM5's SMs and clocks), A100 datasheet (312,
# 19.5), V100 SXM2 datasheet (125 fp16, 15.7 fp32; no bf16 tensor cores), L40S, L4 and A10 datasheets. The one
# table of peaks: the acceptance run's MFU reads it too (foldtrain/bench/gpu_plain.py).
# The last field: the cluster preset whose links stand in for links calibrate cannot measure.
PEAKS: tuple[tuple[str, dict[str, float], str], ...] = (
    (r"NVL", {}, "dgx-h100"),  # NVL boards run at lower clocks than their SXM namesakes: measured
    (r"H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2}, "dgx-h100"),
    (r"H100|H200|GH200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, "dgx-h100"),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, "dgx-a100"),
    (r"V100-SXM2", {"fp16": 125.0, "fp32": 15.7}, "cloud-v100-25g"),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6}, "dgx-h100"),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}, "dgx-h100"),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}, "dgx-a100"),
)
DEFAULT_LINKS = "dgx-h100"


def known_peaks(device_name: str) -> tuple[dict[str, float], str]:
    """The peak FLOP/s per dtype the table knows for ``device_name`` (empty: unknown) and its links preset."""
    for pattern, peaks, links in PEAKS:
        if re.search(pattern, device_name):
            return {d: v * 1e12 for d, v in peaks.items()}, links
    return {}, DEFAULT_LINKS


def torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPES[name])


def autocast(device, dtype: str):
    """As foldtrain trains in ``dtype``: autocast over fp32 weights for bf16 and fp16, nothing for fp32."""
    import torch

    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype(dtype))


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_time(fn, device, min_s: float, reps: int = 3) -> float:
    """Seconds per call of ``fn``, the device drained before and after each run of calls: on a GPU the host's
    view (what launches cost when kernels are short), on a CPU simply the time. Best of ``reps`` runs of at
    least ``min_s`` each (one call when ``min_s`` is 0)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = time.perf_counter() - t0
    n = max(1, min(10_000, math.ceil(min_s / max(one, 1e-9))))
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def device_time(fn, device, min_s: float, reps: int = 3) -> float:
    """Seconds of device time per call of ``fn``. On a GPU the calls are queued behind a sleep kernel and timed
    by CUDA events, so the host's launch time (``launch_us`` measures it) stays out of the kernels' rates even
    where a kernel is shorter than its launch; best of ``reps``. Elsewhere :func:`host_time`."""
    if device.type != "cuda":
        return host_time(fn, device, min_s, reps)
    import torch

    one = host_time(fn, device, 0.0, reps=1)
    n = max(2, min(MAX_QUEUED, math.ceil(min_s / max(one, 1e-9))))
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3 / n)
    return best


def operands(m: int, n: int, k: int, layout: str, dt, device):
    """``(M x K)`` and ``(K x N)`` operands stored as ``layout`` says (:mod:`foldtrain.sim.ops`): "nt" the second
    as an ``(N, K)`` weight (a linear layer's forward), "tn" the first as a ``(K, M)`` input (a weight's
    gradient), "nn" both as they are."""
    import torch

    a = torch.randn(k, m, dtype=dt, device=device).t() if layout == "tn" else torch.randn(m, k, dtype=dt, device=device)
    b = torch.randn(n, k, dtype=dt, device=device).t() if layout == "nt" else torch.randn(k, n, dtype=dt, device=device)
    return a, b


def measure_gemms(shapes, dtype: str, device, min_s: float) -> list[float]:
    """FLOP/s of ``(M x K) @ (K x N)`` in ``dtype`` for each ``(M, N, K, layout)`` of ``shapes``."""
    dt = torch_dtype(dtype)
    rates = []
    for m, n, k, layout in shapes:
        a, b = operands(m, n, k, layout, dt, device)
        rates.append(2.0 * m * n * k / device_time(lambda: a @ b, device, min_s))  # noqa: B023 - timed here
    return rates


def sdpa_backend(out) -> str:
    """The kernel SDPA picked, from the autograd node of its output."""
    name = out.grad_fn.name() if out.grad_fn is not None else ""
    for key, backend in (
        ("FlashAttentionForCpu", "flash (CPU)"),
        ("FlashAttention", "flash"),
        ("EfficientAttention", "efficient"),
        ("Cudnn", "cudnn"),
    ):
        if key in name:
            return backend
    return "math"


def measure_attention(shape, dtype: str, device, min_s: float) -> tuple[float, float, str]:
    """Causal SDPA at ``(batch, heads, seq, head_dim)``: forward (autograd recording) and backward FLOP/s as ops
    counts them (``2 b h L^2 hd``, the backward 2.5 times that), and the backend SDPA picked."""
    import torch
    import torch.nn.functional as F

    b, h, L, hd = shape
    dt = torch_dtype(dtype)
    q, k, v = (torch.randn(b, h, L, hd, dtype=dt, device=device, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    fwd = device_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, min_s)
    bwd = device_time(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device, min_s)
    flops = 2.0 * b * h * L * L * hd
    return flops / fwd, 2.5 * flops / bwd, sdpa_backend(out)


def _fwd_bwd(fn, inputs: list, device, min_s: float) -> float:
    """Forward (autograd recording) plus backward time of ``fn()``, the backward taken on ``inputs``."""
    import torch

    out = fn()
    grad = torch.randn_like(out) if out.dim() else None
    fwd = device_time(fn, device, min_s)
    bwd = device_time(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), device, min_s)
    return fwd + bwd


def measure_memory_bound(s: ops.BlockShape, vocab: int, dtype: str, device, min_s: float) -> dict[str, float]:
    """Bytes/s of every kind of :data:`foldtrain.sim.cluster.KIND_BANDWIDTH`: layer norm, GELU (tanh) and the
    loss (foldtrain's ``lm_loss``: fp32 cross-entropy of the logits), forward and backward each, as the model
    runs them at ``s`` (the norm's input is the fp32 residual stream under autocast), with the bytes
    :mod:`foldtrain.sim.ops` counts for them; and :func:`measure_native`'s."""
    import torch
    import torch.nn.functional as F

    from foldtrain.model.gpt import lm_loss

    by = {op.name: op.bytes for op in ops.memory_forward(s) + ops.memory_backward(s)}
    loss_bytes = next(op.bytes for op in ops.head_ops(s, vocab) if op.kind == "softmax")
    dt = torch_dtype(dtype)
    T, cols = s.tokens, vocab // s.t
    out = {}
    with autocast(device, dtype):
        ln = torch.nn.LayerNorm(s.d, device=device)
        x = torch.randn(T, s.d, device=device, requires_grad=True)
        out["norm"] = (by["ln1"] + by["ln1.bwd"]) / _fwd_bwd(lambda: ln(x), [x, *ln.parameters()], device, min_s)
        h = torch.randn(T, s.f // s.t, device=device, dtype=dt, requires_grad=True)
        gelu_t = _fwd_bwd(lambda: F.gelu(h, approximate="tanh"), [h], device, min_s)
        out["gelu"] = (by["gelu"] + by["gelu.bwd"]) / gelu_t
        logits = torch.randn(T, cols, device=device, dtype=dt, requires_grad=True)
        target = torch.randint(0, cols, (T,), device=device)
        out["softmax"] = loss_bytes / _fwd_bwd(lambda: lm_loss(logits, target), [logits], device, min_s)
    return {**out, **measure_native(s, dtype, device, min_s)}


def measure_native(s: ops.BlockShape, dtype: str, device, min_s: float) -> dict[str, float]:
    """Bytes/s of the memory-bound work foldtrain's own block adds (:mod:`foldtrain.sim.ops`, ``native``), at
    ``s`` in ``dtype`` (bf16 for fp32, which has no casts): ``cast``, the residual add of a half branch into the fp32
    stream and a half tensor's cast to fp32; ``pack``, the backward of q, k and v as views of the qkv product
    (a stack and a copy, as autograd runs it); ``reduce``, the four bias gradients' sums over the tokens."""
    import torch

    half = dataclasses.replace(s, native=True, autocast=True, e=2)
    by = {op.name: op.bytes for op in ops.memory_forward(half) + ops.memory_backward(half)}
    dt = torch_dtype("bf16" if dtype == "fp32" else dtype)
    T, d, f, t, heads = s.tokens, s.d, s.f, s.t, s.local_heads
    stream = torch.randn(T, d, device=device)
    branch = torch.randn(T, d, device=device, dtype=dt)
    add = device_time(lambda: stream + branch, device, min_s)
    cast = device_time(lambda: branch.float(), device, min_s)
    qkv = torch.randn(s.b, s.L, 3 * d // t, device=device, dtype=dt, requires_grad=True)
    views = qkv.view(s.b, s.L, heads, 3, d // s.heads).permute(3, 0, 2, 1, 4).unbind(0)
    grads = [torch.randn_like(v) for v in views]
    pack = device_time(lambda: torch.autograd.grad(views, qkv, grads, retain_graph=True), device, min_s)
    cols = [3 * d // t, d, f // t, d]
    dys = [torch.randn(T, n, device=device, dtype=dt) for n in cols]
    reduce = device_time(lambda: [dy.sum(0) for dy in dys], device, min_s)
    return {
        "cast": (by["residual1"] + by["ln1.cast.bwd"]) / (add + cast),
        "pack": by["qkv.grad_pack"] / pack,
        "reduce": by["bias.grad"] / reduce,
    }


def measure_streams(nbytes: int, device, min_s: float) -> dict[str, float]:
    """Bytes/s of a copy (``mem_bw``: read + write), an element-wise add (``elem``: 3 tensors) and the fused
    AdamW step (``adamw``: 28 bytes per fp32 parameter, as the cost model counts it) on ``nbytes`` tensors."""
    import torch

    n = nbytes // 4
    x, y, z = (torch.randn(n, device=device) for _ in range(3))
    out = {
        "mem_bw": 2 * n * 4 / device_time(lambda: y.copy_(x), device, min_s),
        "elem": 3 * n * 4 / device_time(lambda: torch.add(x, y, out=z), device, min_s),
    }
    w = torch.nn.Parameter(x)
    w.grad = torch.randn_like(w)
    adam = torch.optim.AdamW([w], lr=1e-6, fused=True)
    out["adamw"] = 28 * n / device_time(adam.step, device, min_s)
    return out


def measure_launch(device, n: int = 500, reps: int = 5) -> float:
    """Host seconds to launch one eager kernel: ``n`` adds of 1-element tensors back to back after the device is
    drained (fewer than the launch queue holds, so the host never waits for the device); median of ``reps``."""
    import torch

    a, b = torch.zeros(1, device=device), torch.zeros(1, device=device)
    for _ in range(50):
        torch.add(a, b)
    runs = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(a, b)
        runs.append((time.perf_counter() - t0) / n)
    sync(device)
    return statistics.median(runs)


def measure_block(s: ops.BlockShape, dtype: str, device, min_s: float) -> tuple[float, float]:
    """Forward (autograd recording) and backward seconds of a real block (:class:`foldtrain.model.gpt.Block`)
    at ``s`` (all heads: the block tensor parallelism slices), as training runs it."""
    import torch

    from foldtrain.model.gpt import Block, GPTShape

    blk = Block(GPTShape(1, s.heads, s.d, s.L, 16)).to(device)
    x = torch.randn(s.b, s.L, s.d, device=device, requires_grad=True)
    with autocast(device, dtype):
        y = blk(x)
        fwd = device_time(lambda: blk(x), device, min_s)
    grad = torch.randn_like(y)
    inputs = [x, *blk.parameters()]
    bwd = device_time(lambda: torch.autograd.grad(y, inputs, grad, retain_graph=True), device, min_s)
    return fwd, bwd


TINY_BLOCK = ops.BlockShape(b=1, L=4, d=16, heads=2, e=4)


def measure_block_overhead(device, launch: float, min_s: float) -> tuple[float, float]:
    """Host work of a block beyond its kernels' launches, per pass (a forward and a backward of twice its cost:
    3): a tiny fp32 block's forward + backward, host-timed, less ``launch`` times the kernels ops counts for it.
    Returns ``(overhead_s, tiny_block_s)``; the overhead is at least 1 ns (the cluster field must be positive)."""
    import torch

    from foldtrain.model.gpt import Block, GPTShape

    s = TINY_BLOCK
    blk = Block(GPTShape(1, s.heads, s.d, s.L, 16)).to(device)
    x = torch.randn(s.b, s.L, s.d, device=device, requires_grad=True)
    t = host_time(lambda: blk(x).sum().backward(), device, min_s)
    kernels = sum(op.kernels for op in ops.block_forward(s) + ops.block_backward(s))
    return max((t - launch * kernels) / 3, 1e-9), t


def memory_overhead(s: ops.BlockShape, vocab: int, dtype: str, device) -> dict[str, float]:
    """What a training process takes beyond the tensors the memory model counts: 3 steps (forward, loss,
    backward, fused AdamW) of a 2-block GPT at ``s``. On a GPU: the device memory in use (``mem_get_info``:
    the CUDA context, cuBLAS and NCCL workspaces, the caching allocator's reserve) less the most the allocator
    handed out (``max_memory_allocated``); ``total``: the device's memory. On a CPU: the process's peak resident
    size, and the machine's memory."""
    import resource

    import torch

    from foldtrain.model.gpt import GPT, GPTShape, lm_loss

    model = GPT(GPTShape(2, s.heads, s.d, s.L, vocab)).to(device)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randint(0, vocab, (s.b, s.L), device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(3):
        with autocast(device, dtype):
            loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"runtime": float(total - free - peak), "total": float(total), "peak": float(peak)}
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    return {"runtime": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "total": float(total), "peak": 0.0}


def fit_gemm_curve(dims, rates, peak: float) -> tuple[float, float]:
    """``(efficiency, half_size)`` of ``rate = peak * efficiency * n / (n + half_size)`` over products whose
    smallest dimension is ``n``; the efficiency at most 1."""
    a, h = fit_rate(dims, rates)
    return min(a / peak, 1.0), h


def fit_attention(seqs, fwd, bwd, peak: float) -> tuple[float, float, float]:
    """``(efficiency, bwd_efficiency, half_seq)`` of ``rate = peak * efficiency * L / (L + half_seq)``: the curve
    fitted to the forward rates where several sequence lengths were measured (else the best forward rate and no
    half), the backward's efficiency the median that puts its rates on the same curve; each at most 1."""
    if len(set(seqs)) > 1:
        a, half = fit_rate(seqs, fwd)
    else:
        a, half = max(fwd), 0.0
    bwd_a = statistics.median(r * (L + half) / L for L, r in zip(seqs, bwd))
    return min(a / peak, 1.0), min(bwd_a / peak, 1.0), half
