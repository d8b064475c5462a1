"""The training step of a rank that holds the whole model: one process, or any data-parallel strategy.

``ReplicatedEngine`` owns the step's loop — micro-batched forward/backward with the loss scaled
for fp16, gradient synchronisation, the loss scaler's verdict, clip and optimizer step — and
composes two pieces: a :class:`~foldtrain.optim.TrainState` (model, optimizer, LR schedule,
precision) and a strategy from :mod:`foldtrain.parallel.dp` that decides how gradients become
global and where the update happens. With the plain :class:`~foldtrain.parallel.dp.Strategy`
it is the single-process step (``--dp.strategy none``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn

from foldtrain.optim import TrainState
from foldtrain.parallel.dp import Strategy


class ReplicatedEngine:
    """One rank's training step over a whole-model replica (implements :class:`foldtrain.engine.Engine`)."""

    def __init__(
        self, model: nn.Module, cfg, device: torch.device, micro_batch: int, strategy: type[Strategy] = Strategy
    ):
        self.cfg = cfg
        self.device = device
        self.micro_batch = micro_batch
        self.state = TrainState(model, cfg, device, copy_masters=not strategy.keeps_own_masters)
        self.strategy = strategy(self.state, cfg)

    # ------------------------------------------------------------------ what the loop reads
    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def precision(self):
        return self.state.precision

    @property
    def lr(self) -> float:
        return self.strategy.lr

    @property
    def dp_rank(self) -> int:
        return self.strategy.dp_rank

    @property
    def dp_world(self) -> int:
        return self.strategy.dp_world

    @property
    def last_grad_norm(self) -> float:
        return self.strategy.last_grad_norm

    def batch(self, sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.strategy.batch(sampler, step)

    def stats(self) -> dict[str, float]:
        return self.strategy.stats()

    def between_steps(self) -> None:
        """Nothing waits for the loop here: the strategies start their next-step work inside ``train_step``."""

    def flush(self) -> None:
        """Complete what the strategy left in flight into the next step (sharded-ps: the all-gathers
        of the updated parameters, which the next forward would otherwise wait for)."""
        self.strategy.flush()

    # ------------------------------------------------------------------ the step
    def micro_batches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mb = self.micro_batch or x.shape[0]
        for i in range(0, x.shape[0], mb):
            yield x[i : i + mb], y[i : i + mb]

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.precision.forward_context():
            return self.strategy.loss(self.strategy.forward(x), y)

    shared = None  # the strategies' own loss reductions carry nothing else: the loop agrees by itself

    def train_step(self, x: torch.Tensor, y: torch.Tensor, share=None) -> float:
        """Forward/backward this rank's rows of the global batch and update; returns the global mean loss
        (``share`` is not carried here: :attr:`shared` stays None)."""
        s = self.strategy
        with s.step_context():
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            n_micro = math.ceil(x.shape[0] / (self.micro_batch or x.shape[0]))
            total = torch.zeros((), device=self.device)
            scaler = self.precision.scaler
            for i, (xm, ym) in enumerate(self.micro_batches(x, y)):
                with s.no_sync() if i < n_micro - 1 else contextlib.nullcontext():
                    loss = self.forward_loss(xm, ym)
                    s.record_loss(loss.detach())
                    loss = loss / n_micro
                    scaler.loss(loss).backward()
                total += loss.detach()
            s.sync_grads()
            self.state.grads_to_masters()
            finite = s.global_finite(
                scaler.unscale_and_check([p.grad for p in s.optimizer_params() if p.grad is not None])
            )
            s.apply_update(finite)
            scaler.update(finite)
            s.zero_grad()
            return float(s.reduce_scalar(total))

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        def local() -> torch.Tensor:
            self.model.eval()
            losses = [self.forward_loss(x.to(self.device), y.to(self.device)).float() for x, y in batches]
            self.model.train()
            return torch.stack(losses).mean()

        return self.strategy.eval_loss(local)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Model, optimizer, LR schedule and loss scaler, in a form torch.distributed.checkpoint saves.

        In the master modes the fp32 master weights are saved as the model: they are the truth.
        """
        return {**self.strategy.model_optim_state(), **self.state.schedule_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.strategy.load_model_optim_state(sd)
        self.state.load_schedule_state(sd)

    def extra_state(self) -> dict:
        """Per-rank state saved beside the DCP checkpoint (RNG states are added by the manager)."""
        return {}

    def eval_model(self) -> nn.Module | None:
        """The full model with current weights (collective for some strategies)."""
        return self.strategy.eval_model()
