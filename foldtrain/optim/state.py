"""The weights and optimizer of a whole-model replica: what a replicated engine steps.

``TrainState`` holds the model in its precision's dtype; in the master precisions
(``bf16-master``, ``fp16-master``) an fp32 copy of the model (same names, same tying) owns
AdamW and the model keeps half-precision weights and gradients. Data-parallel strategies that
keep the optimizer elsewhere (a shard of it, or on a parameter server) swap it with
:meth:`TrainState.set_optimizer`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from foldtrain.optim.adamw import build_optimizer
from foldtrain.optim.lr import WarmupCosine, restore_lr
from foldtrain.optim.precision import Precision


class TrainState:
    """``copy_masters=False``: the master precisions' fp32 masters are kept by whoever shards the model
    (FSDP's mixed precision), so the model stays fp32 and no copy is made."""

    def __init__(self, model: nn.Module, cfg, device: torch.device, copy_masters: bool = True):
        self.cfg = cfg
        self.device = device
        self.precision = Precision(cfg.precision, device)
        dtype = self.precision.param_dtype if copy_masters else torch.float32
        self.model = model.to(device=device, dtype=dtype)
        self.named_params = list(self.model.named_parameters())
        if self.precision.master and copy_masters:
            self.master_model = copy.deepcopy(self.model).float()
            self.master = [p for _, p in self.master_model.named_parameters()]
            opt_named = list(self.master_model.named_parameters())
        else:
            self.master_model, self.master = None, None
            opt_named = self.named_params
        self.schedule = WarmupCosine(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)
        self.set_optimizer(opt_named)

    def set_optimizer(self, named: list[tuple[str, torch.Tensor]], optim_cfg=None, masters: bool | None = None) -> None:
        """A new AdamW over ``named`` (with ``optim_cfg``, default the run's) and its LR schedule.
        ``masters=False`` drops the fp32 master model (its role taken by whoever owns ``named``)."""
        if masters is False:
            self.master_model, self.master = None, None
        self.optimizer = build_optimizer(named, optim_cfg or self.cfg.optim)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)

    @property
    def step(self) -> int:
        """Optimizer steps taken (= the data position of the next batch)."""
        return self.lr_scheduler.last_epoch

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def optimizer_params(self) -> list[torch.Tensor]:
        return self.master if self.master is not None else [p for _, p in self.named_params]

    def grads_to_masters(self) -> None:
        if self.master is not None:
            for (_, p), m in zip(self.named_params, self.master):
                m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        if self.master is not None:
            for (_, p), m in zip(self.named_params, self.master):
                p.copy_(m)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.model.zero_grad(set_to_none=True)

    def owner(self) -> nn.Module:
        """The module whose parameters are the weights of record (the fp32 masters, if any)."""
        return self.master_model if self.master_model is not None else self.model

    # ------------------------------------------------------------------ checkpoint state
    def model_optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        owner = self.owner()
        return {"model": get_model_state_dict(owner), "optim": get_optimizer_state_dict(owner, self.optimizer)}

    def load_model_optim_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        owner = self.owner()
        set_model_state_dict(owner, sd["model"])
        set_optimizer_state_dict(owner, self.optimizer, sd["optim"])
        self.masters_to_model()

    def schedule_state(self) -> dict:
        return {
            "lr_scheduler": {"last_epoch": self.lr_scheduler.last_epoch},
            "scaler": self.precision.scaler.state_dict(),
        }

    def load_schedule_state(self, sd: dict) -> None:
        restore_lr(self.optimizer, self.lr_scheduler, self.schedule, int(sd["lr_scheduler"]["last_epoch"]))
        self.precision.scaler.load_state_dict(sd["scaler"])
