"""Anchor: the same GPT trained with PyTorch's own ``torch.distributed.pipelining`` schedules, plus
data parallelism "with DDP" (a flat all-reduce of each stage's gradients over the data-parallel
group after the schedule has flushed).

    torchrun --nnodes 2 --nproc_per_node 2 ... -m foldtrain.bench.anchors.torch_pipelining \
        --schedule looped-bfs --parallel.dp 2 --parallel.pp 2 --parallel.virtual 2 \
        --model.preset tiny --train.global_batch 16 --train.seq_len 128 --train.steps 10 --out DIR

``--schedule``: ``gpipe`` (ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved-1f1b``
(ScheduleInterleaved1F1B), ``looped-bfs`` (ScheduleLoopedBFS), ``interleaved-zb``
(ScheduleInterleavedZeroBubble), ``zbv`` (ScheduleZBVZeroBubble) or ``dualpipev`` (ScheduleDualPipeV).
``interleaved-1f1b``, ``looped-bfs`` and ``interleaved-zb`` place ``--parallel.virtual`` V stages per rank
(stage ``s`` on pipeline rank ``s % P``); ``zbv`` and ``dualpipev`` two in a V (rank ``p`` holds stages
``p`` and ``2P - 1 - p``, so the first and the last are both on rank 0); gpipe and 1f1b need V = 1.
Everything else uses ``foldtrain train``'s options: ``--parallel.dp/pp/virtual``, ``--parallel.microbatches``
(M per data-parallel rank; default: micro-batches of ``--train.micro_batch``, else of 1 row), model, data,
optim, precision (autocast around the step).

Layout (as foldtrain's mesh with tp = 1): global rank ``d * P + p``; torchrun's nodes hold whole
pipelines (node = d) when ``--nproc_per_node P``. The ``S = P*V`` segments split the model's
parts like foldtrain's default split: blocks evenly, the remainder to the earliest segments,
the embedding in segment 0 and the head (final LayerNorm + output projection) in segment S-1.
The output projection is tied to the embedding: with P > 1 the last stage holds a copy whose
gradient is summed with the embedding's (an all-reduce between the two end ranks), so both stay
equal; in a V both ends are on rank 0, which sums the two copies' gradients itself (one weight shared by
two stages would have its gradient scaled by each stage's ``scale_grads``: twice). Then one global-norm
clip (norm all-reduced over the pipeline group) and AdamW.

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

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank in a V: p and 2P - 1 - p


def stages_of(schedule: str, P: int, V: int, p: int) -> list[int]:
    """The stages pipeline rank ``p`` holds."""
    if schedule in V_SHAPED:
        return [p, 2 * P - 1 - p]
    return list(range(p, P * V, P))


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


def parse_args(argv: list[str]):
    """``--schedule`` and the foldtrain configuration built from the other options."""
    ap = argparse.ArgumentParser(prog="torch_pipelining", add_help=True)
    ap.add_argument("--schedule", choices=SCHEDULES, default="looped-bfs")
    ns, rest = ap.parse_known_args(argv)
    return ns.schedule, build_config(rest)


def check_layout(schedule: str, P: int, D: int, V: int, world: int) -> None:
    if P * D != world:
        raise SystemExit(f"--parallel.dp {D} x --parallel.pp {P} = {P * D} but {world} processes were launched")
    if schedule in ("gpipe", "1f1b") and V != 1:
        raise SystemExit(f"--schedule {schedule} runs one stage per rank; use --parallel.virtual 1")
    if schedule in V_SHAPED and V != 2:
        raise SystemExit(f"--schedule {schedule} runs two stages per rank in a V; use --parallel.virtual 2")


def make_groups(P: int, D: int, d: int, p: int, split_tie: bool):
    """This rank's pipeline group, data-parallel group and tie group (its pipeline's two end ranks;
    None with P = 1 or ``split_tie`` off). Every rank creates every group, in the same order."""
    pp_groups = [dist.new_group([dd * P + pp for pp in range(P)]) for dd in range(D)]
    dp_groups = [dist.new_group([dd * P + pp for dd in range(D)]) for pp in range(P)]
    tie_groups = [dist.new_group([dd * P, dd * P + P - 1]) for dd in range(D)] if P > 1 and split_tie else []
    return pp_groups[d], dp_groups[p], (tie_groups[d] if tie_groups else None)


def build_segments(cfg, P: int, V: int, mine: list[int], device: torch.device):
    """The data, and this rank's segments ``{s: Segment}`` (``mine``) of the model cut into S = P*V
    segments, on ``device``."""
    data, model = data_and_model(cfg)
    S = P * V
    layers = split_layers(cfg.model.n_layer, S)
    parts = list(model.parts)
    mods = {}
    for s in mine:
        embedding = [parts[0]] if s == 0 else []
        head = [parts[-1]] if s == S - 1 else []
        mods[s] = Segment(embedding + [parts[1 + i] for i in layers[s]] + head)
    if (S - 1) in mods and S > 1:  # the last stage's own copy of the tied output projection
        untie_head(mods[S - 1].parts[-1])
    del model, parts
    for m in mods.values():
        m.to(device)
    return data, mods


def microbatch_count(t, microbatches: int, D: int) -> int:
    """M micro-batches per data-parallel rank: ``--parallel.microbatches``, else of ``--train.micro_batch``
    rows (else 1 row)."""
    rows = t.global_batch // D
    M = microbatches or rows // (t.micro_batch or 1)
    if rows % M:
        raise SystemExit(f"{rows} rows per data-parallel rank do not split into {M} micro-batches")
    return M


def make_schedule(name: str, stages: list, M: int):
    from torch.distributed.pipelining import schedules as tps

    if name == "gpipe":
        return tps.ScheduleGPipe(stages[0], M, loss_fn=loss_fn)
    if name == "1f1b":
        return tps.Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    multi = {
        "interleaved-1f1b": tps.ScheduleInterleaved1F1B,
        "looped-bfs": tps.ScheduleLoopedBFS,
        "interleaved-zb": tps.ScheduleInterleavedZeroBubble,
        "zbv": tps.ScheduleZBVZeroBubble,
        "dualpipev": tps.ScheduleDualPipeV,
    }
    return multi[name](stages, M, loss_fn=loss_fn)


def params_per_stage(mods: dict[int, nn.Module]) -> dict[int, list[nn.Parameter]]:
    """Each parameter once (with P = 1 the first and last segment share the tied weight)."""
    seen: set[int] = set()
    stage_params: dict[int, list[nn.Parameter]] = {}
    for s, m in mods.items():
        stage_params[s] = [q for q in m.parameters() if id(q) not in seen]
        seen.update(id(q) for q in stage_params[s])
    return stage_params


def run_schedule(sched, x: torch.Tensor, y: torch.Tensor, first: bool, last: bool, autocast) -> list[torch.Tensor]:
    """One step of the schedule; the micro-batches' losses (on the last stage, else none)."""
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
    return losses


def average_over_dp(stage_params: dict[int, list[nn.Parameter]], dp_group, D: int) -> None:
    """Data parallel: average each stage's gradients over the dp group (after the flush), one flat
    all-reduce per stage."""
    for params in stage_params.values():
        grads = [q.grad for q in params if q.grad is not None]
        if not grads:
            continue
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(D)
        for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(f)


def clip_global_norm(params: list[nn.Parameter], skip, grad_clip: float, pp_group, P: int, device) -> torch.Tensor:
    """The gradients' global norm over the pipeline (``skip``, the last stage's tied copy, not counted
    twice), and the clip to ``grad_clip`` when positive."""
    norm_params = [q for q in params if q.grad is not None and q is not skip]
    sq = torch.zeros(1, device=device)
    for q in norm_params:
        sq += q.grad.float().pow(2).sum()
    if P > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    if grad_clip > 0:
        coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
        for q in params:
            if q.grad is not None:
                q.grad.mul_(coef.to(q.grad.dtype))
    return norm


def global_mean_loss(losses: list[torch.Tensor], D: int, device) -> torch.Tensor:
    """The global mean loss on every rank (one all-reduce, as foldtrain logs it)."""
    lt = torch.zeros(1, device=device)
    if losses:
        lt += torch.stack([loss.detach().float() for loss in losses]).mean() / D
    dist.all_reduce(lt)
    return lt


def main(argv: list[str]) -> int:
    schedule, cfg = parse_args(argv)
    t, o, par = cfg.train, cfg.optim, cfg.parallel
    from torch.distributed.pipelining import PipelineStage

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    P, D, V = par.pp, par.dp, par.virtual
    check_layout(schedule, P, D, V, world)
    device = setup_device(t, local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.dp.timeout_s))
    d, p = divmod(rank, P)
    mine = stages_of(schedule, P, V, p)
    pp_group, dp_group, tie_group = make_groups(P, D, d, p, split_tie=schedule not in V_SHAPED)
    data, mods = build_segments(cfg, P, V, mine, device)
    S = P * V
    stages = [PipelineStage(mods[s], s, S, device, group=pp_group) for s in mods]
    sched = make_schedule(schedule, stages, microbatch_count(t, par.microbatches, D))

    stage_params = params_per_stage(mods)
    params = [q for s in mods for q in stage_params[s]]
    opt = adamw(params, o)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    autocast = autocast_for(device, half)
    first, last = 0 in mods, (S - 1) in mods
    emb = mods[0].parts[0].wte.weight if first else None
    head = mods[S - 1].parts[-1].lm_head.weight if last and S > 1 else None
    tied_here = emb if emb is not None else head
    # the norm counts the tied weight once: the first stage's copy, not the last stage's
    norm_skip = head

    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    metrics = Metrics(cfg, rank, device)
    for step in range(t.steps):
        t0 = time.perf_counter()
        lr = set_lr(opt, lr_at(step, o, t.steps))
        x, y = sampler.rank_batch(step, t.global_batch, d, D)
        losses = run_schedule(sched, x.to(device), y.to(device), first, last, autocast)
        if D > 1:
            average_over_dp(stage_params, dp_group, D)
        # the two copies of the tied embedding / output projection: sum their gradients
        if tie_group is not None and tied_here is not None and tied_here.grad is not None:
            dist.all_reduce(tied_here.grad, group=tie_group)
        elif emb is not None and head is not None:  # a V: both copies here
            emb.grad.add_(head.grad)
            head.grad.copy_(emb.grad)
        norm = clip_global_norm(params, norm_skip, o.grad_clip, pp_group, P, device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lt = global_mean_loss(losses, D, device)
        dt = time.perf_counter() - t0
        metrics.write(step, dt, lt, lr=lr, grad_norm=norm)
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
