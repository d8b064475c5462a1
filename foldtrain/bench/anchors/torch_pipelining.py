"""Anchor: the same GPT trained with PyTorch's own ``torch.distributed.pipelining`` schedules, plus
data parallelism "with DDP" (a flat all-reduce of each stage's gradients over the data-parallel
group after the schedule has flushed).

    torchrun --nnodes 2 --nproc_per_node 2 ... -m foldtrain.bench.anchors.torch_pipelining \
        --schedule looped-bfs --parallel.dp 2 --parallel.pp 2 --parallel.virtual 2 \
        --model.preset tiny --train.global_batch 16 --train.seq_len 128 --train.steps 10 --out DIR

``--schedule``: ``gpipe`` (ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved-1f1b``
(ScheduleInterleaved1F1B) or ``looped-bfs`` (ScheduleLoopedBFS); the last two place
``--parallel.virtual`` V stages per rank (stage ``s`` on pipeline rank ``s % P``), the first two
need V = 1. Everything else uses ``foldtrain train``'s options: ``--parallel.dp/pp/virtual``,
``--parallel.microbatches`` (M per data-parallel rank; default: micro-batches of
``--train.micro_batch``, else of 1 row), model, data, optim, precision (autocast around the step).

Layout (as foldtrain's mesh with tp = 1): global rank ``d * P + p``; torchrun's nodes hold whole
pipelines (node = d) when ``--nproc_per_node P``. The ``S = P*V`` segments split the model's
parts like foldtrain's default split: blocks evenly, the remainder to the earliest segments,
the embedding in segment 0 and the head (final LayerNorm + output projection) in segment S-1.
The output projection is tied to the embedding: with P > 1 the last stage holds a copy whose
gradient is summed with the embedding's (an all-reduce between the two end ranks), so both stay
equal. Then one global-norm clip (norm all-reduced over the pipeline group) and AdamW.

Rank 0 writes ``metrics.jsonl``: ``step``, ``loss`` (the global mean, one all-reduce as in
foldtrain), ``lr``, ``step_time_s``, ``tokens_per_s``, ``peak_mem_mb``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from foldtrain.bench.anchors.common import (
    Metrics,
    adamw,
    autocast_for,
    data_and_model,
    loss_fn,
    lr_at,
    set_lr,
    setup_device,
    untie_head,
)
from foldtrain.config import build_config
from foldtrain.data import SequenceSampler

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")


class Segment(nn.Module):
    """Consecutive parts of the GPT (embedding / blocks / head) as one pipeline stage."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.parts:
            x = p(x)
        return x


def split_layers(n_layer: int, segments: int) -> list[list[int]]:
    """Block indices per segment: even split, remainder to the earliest segments."""
    if n_layer < segments:
        raise SystemExit(f"{n_layer} layers cannot fill {segments} pipeline segments; use more layers or fewer stages")
    base, extra = divmod(n_layer, segments)
    out, i = [], 0
    for s in range(segments):
        n = base + (1 if s < extra else 0)
        out.append(list(range(i, i + n)))
        i += n
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="torch_pipelining", add_help=True)
    ap.add_argument("--schedule", choices=SCHEDULES, default="looped-bfs")
    ns, rest = ap.parse_known_args(argv)
    cfg = build_config(rest)
    t, o, par = cfg.train, cfg.optim, cfg.parallel
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
    )

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    P, D, V = par.pp, par.dp, par.virtual
    if P * D != world:
        raise SystemExit(f"--parallel.dp {D} x --parallel.pp {P} = {P * D} but {world} processes were launched")
    if ns.schedule in ("gpipe", "1f1b") and V != 1:
        raise SystemExit(f"--schedule {ns.schedule} runs one stage per rank; use --parallel.virtual 1")
    device = setup_device(t, local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.dp.timeout_s))
    d, p = divmod(rank, P)
    # every rank creates every group, in the same order
    pp_groups = [dist.new_group([dd * P + pp for pp in range(P)]) for dd in range(D)]
    dp_groups = [dist.new_group([dd * P + pp for dd in range(D)]) for pp in range(P)]
    tie_groups = [dist.new_group([dd * P, dd * P + P - 1]) for dd in range(D)] if P > 1 else []
    pp_group, dp_group = pp_groups[d], dp_groups[p]

    # ---- model, cut into S = P*V segments; this rank keeps segments p, p+P, ...
    data, model = data_and_model(cfg)
    S = P * V
    layers = split_layers(cfg.model.n_layer, S)
    parts = list(model.parts)
    local_segs = list(range(p, S, P))
    mods = {}
    for s in local_segs:
        seg_parts = (
            ([parts[0]] if s == 0 else []) + [parts[1 + i] for i in layers[s]] + ([parts[-1]] if s == S - 1 else [])
        )
        mods[s] = Segment(seg_parts)
    if P > 1 and (S - 1) in mods:  # the last stage's own copy of the tied output projection
        untie_head(mods[S - 1].parts[-1])
    del model, parts
    for m in mods.values():
        m.to(device)
    stages = [PipelineStage(mods[s], s, S, device, group=pp_group) for s in local_segs]

    # ---- micro-batches per data-parallel rank
    rows = t.global_batch // D
    if par.microbatches:
        M = par.microbatches
    else:
        M = rows // (t.micro_batch or 1)
    if rows % M:
        raise SystemExit(f"{rows} rows per data-parallel rank do not split into {M} micro-batches")
    if ns.schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], M, loss_fn=loss_fn)
    elif ns.schedule == "1f1b":
        sched = Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    elif ns.schedule == "interleaved-1f1b":
        sched = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    else:
        sched = ScheduleLoopedBFS(stages, M, loss_fn=loss_fn)

    # each parameter once (with P = 1 the first and last segment share the tied weight)
    seen: set[int] = set()
    stage_params: dict[int, list[nn.Parameter]] = {}
    for s, m in mods.items():
        stage_params[s] = [q for q in m.parameters() if id(q) not in seen]
        seen.update(id(q) for q in stage_params[s])
    params = [q for s in mods for q in stage_params[s]]
    opt = adamw(params, o)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    autocast = autocast_for(device, half)
    first, last = 0 in mods, (S - 1) in mods
    tied_here = mods[0].parts[0].wte.weight if first else (mods[S - 1].parts[-1].lm_head.weight if last else None)

    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    metrics = Metrics(cfg, rank, device)
    for step in range(t.steps):
        t0 = time.perf_counter()
        lr = set_lr(opt, lr_at(step, o, t.steps))
        x, y = sampler.rank_batch(step, t.global_batch, d, D)
        x, y = x.to(device), y.to(device)
        losses: list[torch.Tensor] = []
        with autocast():
            if first and last:
                sched.step(x, target=y, losses=losses)
            elif first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
        # data parallel: average each stage's gradients over the dp group (after the flush)
        if D > 1:
            for s in mods:
                grads = [q.grad for q in stage_params[s] if q.grad is not None]
                if not grads:
                    continue
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=dp_group)
                flat.div_(D)
                for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(f)
        # the two copies of the tied embedding / output projection: sum their gradients
        if tie_groups and tied_here is not None and tied_here.grad is not None:
            dist.all_reduce(tied_here.grad, group=tie_groups[d])
        # global-norm clip (the last stage's tied copy is not counted twice)
        norm_params = [q for q in params if q.grad is not None and not (last and not first and q is tied_here)]
        sq = torch.zeros(1, device=device)
        for q in norm_params:
            sq += q.grad.float().pow(2).sum()
        if P > 1:
            dist.all_reduce(sq, group=pp_group)
        norm = sq.sqrt()
        if o.grad_clip > 0:
            coef = torch.clamp(o.grad_clip / (norm + 1e-6), max=1.0)
            for q in params:
                if q.grad is not None:
                    q.grad.mul_(coef.to(q.grad.dtype))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the global mean loss on every rank (one all-reduce, as foldtrain logs it)
        lt = torch.zeros(1, device=device)
        if losses:
            lt += torch.stack([l.detach().float() for l in losses]).mean() / D
        dist.all_reduce(lt)
        dt = time.perf_counter() - t0
        metrics.write(step, dt, lt, lr=lr, grad_norm=norm)
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
