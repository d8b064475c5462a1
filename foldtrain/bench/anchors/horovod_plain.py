"""Anchor: the minimal Horovod training loop (ring all-reduce with tensor fusion), used only when
``import horovod.torch`` works.

    horovodrun -np N -H localhost:N python -m foldtrain.bench.anchors.horovod_plain \
        --model.preset tiny --train.global_batch 16 --train.seq_len 128 --train.steps 15 --out DIR

Same options, model, data, AdamW, schedule and metrics as :mod:`.ddp_plain`; gradients are
averaged by ``hvd.DistributedOptimizer`` (``backward_passes_per_step`` = the number of
accumulation micro-batches; ``HOROVOD_FUSION_THRESHOLD`` is taken from ``--dp.fusion_mb``);
``--dp.compression fp16`` maps to ``hvd.Compression.fp16``. Precision: autocast as in ddp_plain.
Horovod's own tuning stays in its environment: ``foldtrain bench dp`` sets ``HOROVOD_CYCLE_TIME``
(``--horovod_cycle_ms``, default 20 ms instead of Horovod's 1) for this loop and for
``--dp.strategy horovod`` alike.
"""

from __future__ import annotations

import os
import sys
import time

import torch

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
    os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(int(cfg.dp.fusion_mb * 2**20)))
    import horovod.torch as hvd

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    device = setup_device(t, hvd.local_rank())
    data, model = data_and_model(cfg)
    model = model.to(device)
    opt = adamw(model.parameters(), o, foreach=None)
    rows = t.global_batch // world
    micro = t.micro_batch or rows
    n_micro = rows // micro
    compression = hvd.Compression.fp16 if cfg.dp.compression == "fp16" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), compression=compression, backward_passes_per_step=n_micro
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    half = HALF.get(cfg.precision)
    autocast = autocast_for(device, half)
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)
    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    metrics = Metrics(cfg, rank, device)
    for step in range(t.steps):
        t0 = time.perf_counter()
        lr = set_lr(opt, lr_at(step, o, t.steps))
        x, y = sampler.rank_batch(step, t.global_batch, rank, world)
        x, y = x.to(device), y.to(device)
        total = 0.0
        for xm, ym in micro_batches(x, y, n_micro, micro):
            with autocast():
                logits = model(xm)
            loss = loss_fn(logits, ym) / n_micro
            scaler.scale(loss).backward()
            total += loss.item()
        opt.synchronize()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip) if o.grad_clip > 0 else torch.zeros(())
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        metrics.write(step, dt, total, lr=lr, grad_norm=norm)
    metrics.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
