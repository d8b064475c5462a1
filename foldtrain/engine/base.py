"""The one interface every training engine implements; the loop (``foldtrain.train``) uses only this.

Engines are peers, not a class hierarchy: :class:`~foldtrain.engine.replicated.ReplicatedEngine`
(every rank holds the whole model: one process, or a data-parallel strategy) and
:class:`~foldtrain.engine.pipeline.PipelineEngine` (data x pipeline x tensor). They share pieces by
composition (:mod:`foldtrain.optim`: AdamW, LR schedule, precision, replica state).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class Engine(Protocol):
    device: torch.device

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""

    @property
    def last_grad_norm(self) -> float:
        """The global gradient norm of the last step (before clipping)."""

    def batch(self, sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of ``step``."""

    shared: list[list[float]] | None

    def train_step(self, x: torch.Tensor, y: torch.Tensor, share=None) -> float:
        """One optimizer step on this rank's rows; returns the global mean loss (the same on every rank).
        ``share``: a callable giving a few floats of this rank's that the engine may carry in the step's own
        closing collective; every rank's then land in :attr:`shared` (None where the engine carries none), so
        the loop needs no collective of its own after the step."""

    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` (identical on every rank), without updating anything."""

    def between_steps(self) -> None:
        """Start the work that runs between two steps (the 3D engine's deferred reductions), after the loop's
        own per-step collectives; ``train_step`` and ``flush`` do it themselves when the loop did not."""

    def flush(self) -> None:
        """Complete any work deferred into the next step (before reading or saving weights)."""

    def stats(self) -> dict[str, float]:
        """The last step's measurements for metrics.jsonl (communication, idle time...)."""

    def state_dict(self) -> dict:
        """Model, optimizer, LR schedule and loss scaler, as torch.distributed.checkpoint saves them."""

    def load_state_dict(self, sd: dict) -> None:
        """Load what ``state_dict`` returned (after DCP filled it in place)."""

    def extra_state(self) -> dict:
        """Per-rank state saved beside the DCP checkpoint."""

    def eval_model(self) -> nn.Module | None:
        """Collective on some layouts: the full model with current weights (None on ranks that get none)."""
