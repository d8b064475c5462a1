"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``."""

from __future__ import annotations

import math


class WarmupCosine:
    """A picklable LambdaLR factor (lr = base_lr * factor(step)); its state is just the config."""

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int):
        self.lr, self.min_lr, self.warmup, self.total = lr, min_lr, warmup_steps, total_steps

    def lr_at(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if step >= self.total:
            return self.min_lr
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr


def restore_lr(optimizer, lr_scheduler, schedule: WarmupCosine, step: int) -> None:
    """Put a ``LambdaLR(optimizer, schedule)`` at ``step`` (after loading a checkpoint), learning
    rates included, without stepping it."""
    lr_scheduler.last_epoch = step
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * schedule(step)
    lr_scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
