"""The training step of one rank: micro-batched forward/backward, gradient sync, clip, optimizer step.

``Engine`` is the single-process step (``--dp.strategy none``). Data-parallel strategies
subclass it and override the hooks ``no_sync`` (skip communication on accumulation
micro-batches), ``sync_grads`` (make gradients global), ``apply_update`` (e.g. a parameter
server's push/pull), ``reduce_scalar`` (average a logged value over ranks) and
``model_optim_state`` / ``load_model_optim_state`` (checkpoint state that is sharded or held by
servers); the loop itself, precision handling and clipping stay here, in one place.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Iterator

import torch
import torch.nn as nn

from foldtrain.parallel.tp_loss import tp_loss
from foldtrain.train.lr import WarmupCosine
from foldtrain.train.precision import Precision


def build_optimizer(params_named: list[tuple[str, nn.Parameter]], optim_cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, LayerNorms); order follows the model."""
    decay = [p for _, p in params_named if p.dim() >= 2]
    no_decay = [p for _, p in params_named if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, foreach=True)


class Engine:
    """One rank's training step; the whole story for a single process."""

    def __init__(self, model: nn.Module, cfg, device: torch.device, micro_batch: int):
        self.cfg = cfg
        self.device = device
        self.micro_batch = micro_batch
        self.precision = Precision(cfg.precision, device)
        self.model = model.to(device=device, dtype=self.precision.param_dtype)
        self.named_params = [(n, p) for n, p in self.model.named_parameters()]
        if self.precision.master:
            # an fp32 copy of the model (same names, same tying) owns the optimizer: the master weights;
            # the model itself keeps half-precision weights and gradients
            self.master_model = copy.deepcopy(self.model).float()
            self.master = [p for _, p in self.master_model.named_parameters()]
            opt_named = list(self.master_model.named_parameters())
        else:
            self.master_model, self.master = None, None
            opt_named = self.named_params
        self.optimizer = build_optimizer(opt_named, cfg.optim)
        self.schedule = WarmupCosine(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.last_grad_norm = 0.0
        self.dp_rank, self.dp_world = 0, 1  # which rows of the global batch this rank computes

    def batch(self, sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of ``step`` (the data position is just the step)."""
        return sampler.rank_batch(step, self.cfg.train.global_batch, self.dp_rank, self.dp_world)

    def stats(self) -> dict[str, float]:
        """Per-step measurements logged to metrics.jsonl (communication bytes, wait time...)."""
        return {}

    def extra_state(self) -> dict:
        """Per-rank state saved beside the DCP checkpoint (RNG states are added by the manager)."""
        return {}

    # ------------------------------------------------------------------ hooks for strategies
    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_grads(self) -> None:
        """Make every parameter's .grad the global sum-mean over data-parallel ranks."""

    def reduce_scalar(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def global_finite(self, finite: bool) -> bool:
        """Agree on the loss scaler's skip decision across ranks that hold different gradient shards."""
        return finite

    def apply_update(self, grads_finite: bool) -> None:
        """Clip and step the optimizer on the (synchronised) gradients, unless they overflowed."""
        if grads_finite:
            self.last_grad_norm = self.clip(self.optimizer_params())
            self.optimizer.step()
            if self.master is not None:
                with torch.no_grad():
                    for (_, p), m in zip(self.named_params, self.master):
                        p.copy_(m)
        self.lr_scheduler.step()

    # ------------------------------------------------------------------ the step
    def optimizer_params(self) -> list[torch.Tensor]:
        return self.master if self.master is not None else [p for _, p in self.named_params]

    def clip(self, params: list[torch.Tensor]) -> float:
        clip = self.cfg.optim.grad_clip
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        return float(norm)

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mb = self.micro_batch or x.shape[0]
        for i in range(0, x.shape[0], mb):
            yield x[i : i + mb], y[i : i + mb]

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.precision.forward_context():
            return tp_loss(self.model(x), y)  # = lm_loss on plain logits; vocab-parallel on sharded ones

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward/backward this rank's rows of the global batch and update; returns the global mean loss."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        n_micro = math.ceil(x.shape[0] / (self.micro_batch or x.shape[0]))
        total = torch.zeros((), device=self.device)
        scaler = self.precision.scaler
        for i, (xm, ym) in enumerate(self.micro_batches(x, y)):
            ctx = self.no_sync() if i < n_micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = self.forward_loss(xm, ym) / n_micro
                scaler.loss(loss).backward()
            total += loss.detach()
        self.sync_grads()
        if self.master is not None:
            for (_, p), m in zip(self.named_params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
        opt_params = self.optimizer_params()
        finite = self.global_finite(scaler.unscale_and_check([p.grad for p in opt_params if p.grad is not None]))
        self.apply_update(finite)
        scaler.update(finite)
        self.zero_grad()
        return float(self.reduce_scalar(total))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self.model.eval()
        losses = [self.forward_loss(x.to(self.device), y.to(self.device)).float() for x, y in batches]
        self.model.train()
        return float(self.reduce_scalar(torch.stack(losses).mean()))

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Model, optimizer, LR schedule and loss scaler, in a form torch.distributed.checkpoint saves.

        In the master modes the fp32 master weights are saved as the model: they are the truth.
        """
        return {
            **self.model_optim_state(),
            "lr_scheduler": {"last_epoch": self.lr_scheduler.last_epoch},
            "scaler": self.precision.scaler.state_dict(),
        }

    def model_optim_state(self) -> dict:
        """The ``model`` and ``optim`` entries of ``state_dict``; strategies that shard them override this pair."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        owner = self.master_model if self.master_model is not None else self.model
        return {"model": get_model_state_dict(owner), "optim": get_optimizer_state_dict(owner, self.optimizer)}

    def load_model_optim_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        owner = self.master_model if self.master_model is not None else self.model
        set_model_state_dict(owner, sd["model"])
        set_optimizer_state_dict(owner, self.optimizer, sd["optim"])
        if self.master_model is not None:
            with torch.no_grad():
                for (_, p), m in zip(self.named_params, self.master):
                    p.copy_(m)

    def load_state_dict(self, sd: dict) -> None:
        self.load_model_optim_state(sd)
        self.lr_scheduler.last_epoch = int(sd["lr_scheduler"]["last_epoch"])
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * self.schedule(self.lr_scheduler.last_epoch)
        self.lr_scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.precision.scaler.load_state_dict(sd["scaler"])

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def eval_model(self) -> nn.Module:
        """The full model with current weights (fp32 masters if any), for sampling and export."""
        return self.master_model if self.master_model is not None else self.model
