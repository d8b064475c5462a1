"""Anchor: the minimal plain-PyTorch FSDP2 training loop a user would write (no foldtrain engine).

    torchrun --standalone --nproc_per_node N -m foldtrain.bench.anchors.fsdp_plain \
        --model.preset tiny --train.global_batch 16 --train.seq_len 128 --train.steps 15 --precision fp32 --out DIR

The same options, model, data, AdamW, LR schedule and metrics as :mod:`.ddp_plain`; the model is
wrapped as the FSDP2 tutorial and torchtitan do: ``fully_shard`` on every transformer block, then on
the whole model, ``--dp.reshard_after_forward`` as given. Precision: ``bf16-master`` / ``fp16-master``
are FSDP's ``MixedPrecisionPolicy`` (half-precision compute weights, fp32 gradient reduction, fp32
sharded parameters); ``bf16`` / ``fp16`` are autocast over fp32 weights; fp16 scales the loss with
``GradScaler`` (which handles FSDP's DTensor gradients). Gradient accumulation: gradient sync off on
all but the last micro-batch (``set_requires_gradient_sync``).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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


def shard(model, cfg, world: int, device: torch.device):
    """FSDP2 over all ranks: each block its own unit, the rest (embedding, head, their tie) the root's."""
    from torch.distributed.device_mesh import init_device_mesh

    half = HALF.get(cfg.precision) if cfg.precision.endswith("-master") else None
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32 if half else None)
    opts = dict(
        mesh=init_device_mesh(device.type, (world,)),
        reshard_after_forward=cfg.dp.reshard_after_forward,
        mp_policy=policy,
    )
    for block in model.blocks:
        fully_shard(block, **opts)
    fully_shard(model, **opts)
    return model


def main(argv: list[str]) -> int:
    cfg = build_config(argv)
    t, o = cfg.train, cfg.optim
    if "RANK" not in os.environ:  # plain `python fsdp_plain.py`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29532")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = setup_device(t, local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.dp.timeout_s))

    data, model = data_and_model(cfg)
    model = shard(model.to(device), cfg, world, device)
    opt = adamw(model.parameters(), o)
    half = HALF.get(cfg.precision)
    autocast = autocast_for(device, None if cfg.precision.endswith("-master") else half)
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)

    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    rows = t.global_batch // world
    micro = t.micro_batch or rows
    n_micro = rows // micro
    metrics = Metrics(cfg, rank, device)
    for step in range(t.steps):
        t0 = time.perf_counter()
        lr = set_lr(opt, lr_at(step, o, t.steps))
        x, y = sampler.rank_batch(step, t.global_batch, rank, world)
        x, y = x.to(device), y.to(device)
        total = 0.0
        for i, (xm, ym) in enumerate(micro_batches(x, y, n_micro, micro)):
            model.set_requires_gradient_sync(i == n_micro - 1)
            with autocast():
                logits = model(xm)
            loss = loss_fn(logits, ym) / n_micro
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip) if o.grad_clip > 0 else torch.zeros(())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        mean = torch.tensor([total], device=device)
        dist.all_reduce(mean)  # the logged loss is the global batch's, as foldtrain logs it
        metrics.write(step, time.perf_counter() - t0, mean.item() / world, lr=lr, grad_norm=float(norm))
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
