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
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from foldtrain.bench.anchors.common import (
    HALF,
    Metrics,
    adamw,
    autocast_for,
    data_and_model,
    loss_fn,
    lr_at,
    micro_batches,
    set_lr,
    setup_device,
)
from foldtrain.config import build_config
from foldtrain.data import SequenceSampler


def main(argv: list[str]) -> int:
    cfg = build_config(argv)
    t, o = cfg.train, cfg.optim
    if "RANK" not in os.environ:  # plain `python ddp_plain.py`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = setup_device(t, local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.dp.timeout_s))

    data, model = data_and_model(cfg)
    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cfg.dp.bucket_mb)
    opt = adamw(model.parameters(), o)
    half = HALF.get(cfg.precision)
    autocast = autocast_for(device, half)
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)

    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    rows = t.global_batch // world
    micro = t.micro_batch or rows
    n_micro = rows // micro
    torch.manual_seed(t.seed + 1000 * rank)
    metrics = Metrics(cfg, rank, device)
    for step in range(t.steps):
        t0 = time.perf_counter()
        lr = set_lr(opt, lr_at(step, o, t.steps))
        x, y = sampler.rank_batch(step, t.global_batch, rank, world)
        x, y = x.to(device), y.to(device)
        total = 0.0
        for i, (xm, ym) in enumerate(micro_batches(x, y, n_micro, micro)):
            with ddp.no_sync() if i < n_micro - 1 else contextlib.nullcontext():
                with autocast():
                    logits = ddp(xm)
                loss = loss_fn(logits, ym) / n_micro
                scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip) if o.grad_clip > 0 else torch.zeros(())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        metrics.write(step, dt, total, lr=lr, grad_norm=norm)
    metrics.close()
    # leave together, drop DDP's reducer (it holds the group's work objects), then tear the group down:
    # a rank exiting with gloo's threads still running dies in their destructors ("terminate called
    # without an active exception", SIGABRT; seen once in a CI run of test_ddp_plain_anchor_world2)
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
