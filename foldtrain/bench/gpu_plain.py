"""What the GPU acceptance run's throughput check measures against: the plain PyTorch loop, the micro-batch
probe, model FLOPs and the devices' peaks.

The plain loop is the one anyone would write after nanoGPT: foldtrain's GPT, autocast, the fused AdamW on a
GPU, clipping, a learning rate set per step; nothing else. It shares foldtrain's model, data and optimizer
settings with the anchors (:mod:`foldtrain.bench.anchors.common`).
"""

from __future__ import annotations

import gc
import time

import torch

from foldtrain.bench.anchors.common import HALF, autocast_for, loss_fn, lr_at, set_lr
from foldtrain.model import GPT, GPTShape, analytic_param_count
from foldtrain.model.presets import train_flops_per_token


def device_peak_tflops(name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a device named ``name`` (torch.cuda.get_device_name), from calibrate's
    datasheet table (:data:`foldtrain.calibrate.gpu.PEAKS`), or None if the table has none (no MFU then)."""
    from foldtrain.calibrate.gpu import known_peaks

    peak = known_peaks(name)[0].get("bf16")
    return peak / 1e12 if peak else None


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token of model config ``m`` (:func:`foldtrain.model.presets.train_flops_per_token`)."""
    n = analytic_param_count(m.n_layer, m.d_model, m.context, m.vocab_size)
    return train_flops_per_token(n, m.n_layer, seq_len, m.d_model)


def oom_error() -> tuple[type[BaseException], ...]:
    """The exceptions a device out of memory raises (torch.OutOfMemoryError is newer than torch.cuda's)."""
    return tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class PlainLoop:
    """A textbook training loop over foldtrain's GPT (its initial weights, its data, its AdamW settings)."""

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, device
        torch.manual_seed(cfg.train.seed)
        self.model = GPT(GPTShape.from_config(cfg.model), cfg.train.seed).to(device)
        o = cfg.optim
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            **kind,
        )
        self.autocast = autocast_for(device, HALF.get(cfg.precision))
        self.step_no = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the batch ``(x, y)``; returns the loss (a device synchronisation)."""
        o = self.cfg.optim
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        set_lr(self.opt, lr_at(self.step_no, o, self.cfg.train.steps))
        with self.autocast():
            logits = self.model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        return loss.item()

    def timed(self, sampler, rows: int, start: int, steps: int) -> list[float]:
        """Seconds of each of ``steps`` steps on the sampler's global batches ``start ..`` of ``rows`` rows."""
        times = []
        for s in range(start, start + steps):
            t0 = time.perf_counter()
            x, y = sampler.global_batch(s, rows)
            self.step(x, y)
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        del self.model, self.opt
        free_device_memory(self.device)


def probe_micro_batches(
    loop: PlainLoop, sampler, candidates: tuple[int, ...], seq_len: int, steps: int = 2
) -> tuple[int, list[tuple[int, float | None]]]:
    """Try each micro-batch in ``candidates`` (ascending) with one warm-up and ``steps`` timed plain steps;
    stop at the first that runs out of memory or gains under 3% over the best so far. Returns the fastest
    micro-batch and every probe as (micro-batch, tokens/s or None for out of memory)."""
    probes: list[tuple[int, float | None]] = []
    best, best_rate = candidates[0], 0.0
    for mb in candidates:
        try:
            loop.timed(sampler, mb, 0, 1)
            times = loop.timed(sampler, mb, 1, steps)
        except oom_error():
            loop.opt.zero_grad(set_to_none=True)
            free_device_memory(loop.device)
            probes.append((mb, None))
            break
        rate = mb * seq_len / min(times)
        probes.append((mb, rate))
        gain = rate / best_rate if best_rate else float("inf")
        if rate > best_rate:
            best, best_rate = mb, rate
        if gain < 1.03:
            break
    return best, probes
