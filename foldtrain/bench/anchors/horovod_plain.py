"""Anchor: the minimal Horovod training loop (ring all-reduce with tensor fusion), used only when
``import horovod.torch`` works.

    horovodrun -np N -H localhost:N python -m foldtrain.bench.anchors.horovod_plain \
        --model.preset tiny --train.global_batch 16 --train.seq_len 128 --train.steps 15 --out DIR

Same options, model, data, AdamW, schedule and metrics as :mod:`.ddp_plain`; gradients are
averaged by ``hvd.DistributedOptimizer`` (``backward_passes_per_step`` = the number of
accumulation micro-batches; ``HOROVOD_FUSION_THRESHOLD`` is taken from ``--dp.fusion_mb``);
``--dp.compression fp16`` maps to ``hvd.Compression.fp16``. Precision: autocast as in ddp_plain.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from foldtrain.bench.anchors.ddp_plain import lr_at, peak_mem_mb
from foldtrain.config import build_config
from foldtrain.data import SequenceSampler, TokenData, resolve_data
from foldtrain.model import GPT, GPTShape


def main(argv: list[str]) -> int:
    cfg = build_config(argv)
    t, o = cfg.train, cfg.optim
    os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(int(cfg.dp.fusion_mb * 2**20)))
    import horovod.torch as hvd

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    use_cuda = torch.cuda.is_available() and t.device != "cpu"
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    data = TokenData.open(resolve_data(cfg.data))
    torch.manual_seed(t.seed)
    model = GPT(GPTShape.from_config(cfg.model)).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    rows = t.global_batch // world
    micro = t.micro_batch or rows
    n_micro = rows // micro
    compression = hvd.Compression.fp16 if cfg.dp.compression == "fp16" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=n_micro)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    half = {"bf16": torch.bfloat16, "bf16-master": torch.bfloat16, "fp16": torch.float16, "fp16-master": torch.float16}.get(cfg.precision)
    autocast = (lambda: torch.autocast(device.type, dtype=half)) if half is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)
    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    out = Path(cfg.out)
    metrics = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = open(out / "metrics.jsonl", "w")
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
            with autocast():
                logits = model(xm)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ym.reshape(-1)) / n_micro
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
        if metrics is not None:
            rec = {"step": step + 1, "loss": total, "lr": lr, "tokens_per_s": t.global_batch * t.seq_len / dt,
                   "step_time_s": dt, "grad_norm": float(norm), "peak_mem_mb": peak_mem_mb(device)}
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
    if metrics is not None:
        metrics.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
