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
