"""Anchor: the minimal plain-PyTorch DDP training loop a user would write (no foldtrain engine).

    torchrun --standalone --nproc_per_node N foldtrain/bench/anchors/ddp_plain.py \
        --model.preset tiny --train.global_batch 16 --train.seq_len 128 --train.steps 15 --precision fp32 --out DIR

It reads the same ``--section.field value`` options as ``foldtrain train`` (only model, data,
train, optim, precision, dp.bucket_mb and out matter) so the benchmark passes both the same
arguments: same model (``foldtrain.model.GPT``, same seed), same data and per-rank rows of the
global batch (``foldtrain.data``), same AdamW (decay on matrices only), LR warm-up + cosine and
gradient clipping. The loop itself is textbook DDP: ``no_sync`` on accumulation micro-batches,
``torch.autocast`` for bf16/fp16 (``*-master`` precisions also map to autocast, which keeps fp32
weights: the AMP-O1 way a DDP user gets mixed precision) and ``GradScaler`` for fp16.

Rank 0 writes ``metrics.jsonl`` with the fields the benchmark reads: ``step``, ``loss``, ``lr``,
``step_time_s``, ``tokens_per_s``, ``peak_mem_mb``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from foldtrain.config import build_config
from foldtrain.data import SequenceSampler, TokenData, resolve_data
from foldtrain.model import GPT, GPTShape


def peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def lr_at(step: int, o, total: int) -> float:
    """Linear warm-up, then cosine decay to min_lr (the schedule foldtrain uses)."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    t = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))


def main(argv: list[str]) -> int:
    cfg = build_config(argv)
    t, o = cfg.train, cfg.optim
    if "RANK" not in os.environ:  # plain `python ddp_plain.py`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and t.device != "cpu"
    device = torch.device("cuda", local % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=cfg.dp.timeout_s))

    data = TokenData.open(resolve_data(cfg.data))
    torch.manual_seed(t.seed)
    model = GPT(GPTShape.from_config(cfg.model)).to(device)
    ddp = DDP(model, device_ids=[device.index] if use_cuda else None, bucket_cap_mb=cfg.dp.bucket_mb)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    half = {"bf16": torch.bfloat16, "bf16-master": torch.bfloat16, "fp16": torch.float16, "fp16-master": torch.float16}.get(cfg.precision)
    autocast = (lambda: torch.autocast(device.type, dtype=half)) if half is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)

    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    rows = t.global_batch // world
    micro = t.micro_batch or rows
    n_micro = rows // micro
    torch.manual_seed(t.seed + 1000 * rank)
    out = Path(cfg.out)
    metrics = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = open(out / "metrics.jsonl", "w")
    tokens_per_step = t.global_batch * t.seq_len
    for step in range(t.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, o, t.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sampler.rank_batch(step, t.global_batch, rank, world)
        x, y = x.to(device), y.to(device)
        total = 0.0
        for i in range(n_micro):
            xm, ym = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
            with ddp.no_sync() if i < n_micro - 1 else contextlib.nullcontext():
                with autocast():
                    logits = ddp(xm)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ym.reshape(-1)) / n_micro
                scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip) if o.grad_clip > 0 else torch.zeros(())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if metrics is not None:
            rec = {"step": step + 1, "loss": total, "lr": lr, "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                   "grad_norm": float(norm), "peak_mem_mb": peak_mem_mb(device)}
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
