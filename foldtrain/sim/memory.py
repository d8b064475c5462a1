"""Memory per pipeline rank: parameters, gradients, optimizer state, masters, buffers, activations.

Static part as in the HP3C'22 appendix: parameters + gradients + AdamW's two fp32 moments
(+ fp32 masters with ``*-master``), sharded over the data-parallel workers by ``sharded-ps``
(moments and masters; ZeRO-2 also shards the gradients, keeping the replica's one bucket at a time),
held only by the servers with ``ps``, sharded (with the gradients and weights, in fp32) by fsdp in the 3D
engine, whose unsharded units and gradients come from a walk of the rank's action list (:mod:`.pipeline_fsdp`).
Communication buffers: the 3D engine's flat per-chunk
reduction buffer and DDP's buckets (a gradient copy each), ``sharded-ps``' one bucket, the
``allreduce`` fusion buffer, the parameter server's message buffers.

Activations: the micro-batches a rank keeps alive, found by walking its action list (a forward
adds its segment's activations, the backward frees them): all ``V M`` at the turn for fold and
GPipe, about ``P`` for 1F1B. Per block and micro-batch Korthikanti et al. (2022), less what the kernels do
not keep (:meth:`.costs.CostModel.act_bytes_block`: the scores under a fused attention kernel, dropout masks
without dropout); with ``--ac full``
only each block's input, plus one block's full activations while it is recomputed. The rank
holding the head also holds three of one micro-batch's fp32 ``(b, L, V)`` tensors at the loss's
backward (log-softmax output, its gradient, the logits' gradient), or the cluster's measured
``loss_buffers``: on a CPU, glibc with ``--train.malloc_cache`` keeps freed blocks, and small
allocations split the holes the loss's large tensors leave, so the resident peak holds more of them.
"""

from __future__ import annotations

from foldtrain.schedules import Schedule, activations_peak

from .costs import CostModel, rank_segments, segment_params, stepped_share
from .pipeline_fsdp import on_thread, peak_buffers, units
from .setup import Setup

GB = 1e9


def rank_memory(
    s: Setup, cm: CostModel, sched: Schedule, p: int, runtime: float = 0.0, server: bool = False
) -> dict[str, float]:
    """Bytes by category for pipeline rank ``p`` (one tensor-parallel shard; ``server``: the ps server rank)."""
    segs = rank_segments(s, p)
    n = sum(segment_params(s, g) for g in segs)
    workers = max(s.dp, 1)
    out: dict[str, float] = {"params": n * s.weight_bytes, "grads": n * s.grad_bytes}
    opt_share = sum(segment_params(s, g) * stepped_share(s, g) for g in segs) / n if n else 1.0
    if s.strategy == "ps":
        opt_share = (1.0 / max(s.servers, 1)) if server else 0.0
    out["optimizer"] = n * 8 * opt_share
    # the distributed optimizer steps views into fp32 weights, fp32 copies of half ones (its gradient slice is
    # transient)
    out["masters"] = n * 4 * opt_share if s.master else 0.0
    if s.strategy == "sharded-ps" and s.dp > 1:
        # ZeRO-2: an fp32 gradient shard and fp32 shard weights (whatever the precision); the replica's
        # gradients live one bucket at a time (the largest, or --dp.shard_budget_mb)
        out["grads"] = out["masters"] = n * 4 / workers
        buf = s.shard_buffer
    elif s.strategy == "fsdp-3d" and s.dp > 1:
        # FSDP2's fp32 shards (parameters, their gradients; AdamW's moments above): no separate masters; the
        # unsharded units and gradients come with the activations' walk below
        out["params"] = out["grads"] = n * 4 / workers
        out["masters"] = 0.0
        buf = 0.0
    elif s.strategy == "ddp" and s.dp > 1:
        buf = n * s.grad_bytes  # DDP's buckets: views of the gradients' dtype (a compressed copy is transient)
    elif s.strategy == "allreduce-3d" and s.dp > 1:
        buf = n * s.grad_bytes * s.wire_factor  # the packed buffers, in the wire dtype with --dp.compression
    elif s.strategy == "allreduce":
        buf = min(s.fusion_bytes, n * s.grad_bytes) * s.wire_factor
    elif s.strategy == "ps":
        buf = (
            n
            * (s.grad_bytes + s.weight_bytes)
            * ((workers if s.servers == 0 else workers / s.servers) if server else 1)
        )
    else:
        buf = 0.0
    out["comm_buffers"] = buf
    per_block = cm.act_bytes_block(recompute=s.ac)
    per_seg = {}
    for g in segs:
        x = s.layers[g] * per_block
        if g == 0:
            x += s.micro_batch * s.seq * s.d_model * s.act_bytes  # embedding output
        per_seg[g] = x
    if s.strategy == "fsdp-3d" and s.dp > 1:  # the most activations and unsharded buffers held together
        blocks, roots = ({g: units(s, g)[k] for g in segs} for k in (0, 1))
        act, out["comm_buffers"] = peak_buffers(s, sched, p, per_seg, blocks, roots, on_thread(cm.c))
    else:
        act = activations_peak(sched, p, per_seg)
    if s.ac:
        act += cm.act_bytes_block(recompute=False)  # one block recomputed at a time
    if s.segments - 1 in segs:
        # one micro-batch's fp32 (b, L, V) tensors at the loss's backward: the log-softmax output saved for it,
        # its gradient and the logits' gradient (the logits themselves are freed after the forward): 3, or
        # as many as `foldtrain calibrate` measured where the host allocator keeps freed blocks as holes
        act += cm.c.loss_buffers * s.micro_batch * s.seq * s.vocab / s.tp * 4
    out["activations"] = act
    out["runtime"] = runtime
    out["total"] = sum(out.values())
    return out


def format_breakdown(mem: dict[str, float]) -> str:
    keys = ("params", "grads", "optimizer", "masters", "comm_buffers", "activations", "runtime")
    return ", ".join(f"{k} {mem[k] / GB:.2f}" for k in keys if mem.get(k)) + f" = {mem['total'] / GB:.2f} GB"
