"""Mixed precision: autocast (``bf16``, ``fp16`` with dynamic loss scaling) and half-precision
models with fp32 master weights (``bf16-master``, ``fp16-master``, Apex O2).

``Precision`` gives the training step three things: a context for the forward pass, a
loss scaler (identity unless fp16) and the dtype the model's own parameters are kept in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class LossScaler:
    """Dynamic loss scaling: skip the step on inf/NaN and back off; grow after ``interval`` good steps.

    Works for gradients on any device and for any strategy, because the strategy hands it the
    already-synchronised gradients (so every rank takes the same skip decision).
    """

    enabled: bool
    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 200
    good_steps: int = 0
    skipped: int = 0

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide gradients by the scale in place; False when any is inf/NaN (step must be skipped)."""
        if not self.enabled:
            return True
        inv = 1.0 / self.scale
        finite = torch.ones((), dtype=torch.bool, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(inv)
            local = g.to_local() if hasattr(g, "to_local") else g  # DTensor: this rank's shard
            finite &= torch.isfinite(local).all()
        return bool(finite)  # this rank's verdict; the engine makes it global (Engine.global_finite)

    def update(self, found_finite: bool) -> None:
        if not self.enabled:
            return
        if found_finite:
            self.good_steps += 1
            if self.good_steps % self.interval == 0:
                self.scale *= self.growth
        else:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps, self.skipped = float(sd["scale"]), int(sd["good_steps"]), int(sd["skipped"])


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.device = device
        half = name.split("-")[0]
        self.half_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(half)
        self.master = name.endswith("-master")
        self.autocast = self.half_dtype is not None and not self.master
        self.scaler = LossScaler(enabled=half == "fp16")

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the model's own parameters (half for the master modes)."""
        return self.half_dtype if self.master else torch.float32

    @property
    def fsdp_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """``(param_dtype, reduce_dtype)`` of FSDP2's ``MixedPrecisionPolicy``: in the master modes the weights
        are gathered in :attr:`param_dtype` for compute and the gradients reduced in fp32, the sharded fp32
        parameters being the masters; otherwise FSDP keeps the parameters' dtype (autocast does the rest)."""
        return (self.param_dtype, torch.float32) if self.master else (None, None)

    def forward_context(self):
        if self.autocast:
            return torch.autocast(device_type=self.device.type, dtype=self.half_dtype)
        return contextlib.nullcontext()
