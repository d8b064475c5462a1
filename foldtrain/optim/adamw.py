"""AdamW as foldtrain uses it: weight decay on matrices only, and in-place access to a parameter's state
(for engines that save or load optimizer state under their own keys)."""

from __future__ import annotations

import torch
import torch.nn as nn


def build_optimizer(params_named: list[tuple[str, nn.Parameter]], optim_cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, LayerNorms); order follows the model.

    The fused kernel where every parameter is a CPU or CUDA tensor, DTensors (FSDP's shards, tensor
    parallelism's) included: it is faster than the multi-tensor (``foreach``) one and needs no temporary
    copy of the moments (``foreach`` makes one of the square roots of the second moments, as large as
    the parameters), so a rank's peak memory stays close to parameters + gradients + moments
    (``foldtrain bench memory``, ``foldtrain bench fsdp-memory``); ``foreach`` elsewhere.
    """
    decay = [p for _, p in params_named if p.dim() >= 2]
    no_decay = [p for _, p in params_named if p.dim() < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    fusable = all(p.device.type in ("cpu", "cuda") for _, p in params_named)
    kind = {"fused": True} if fusable else {"foreach": True}
    return torch.optim.AdamW(
        groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, **kind
    )


def adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``p``'s AdamW state, created (zero moments, step 0) if the optimizer has not stepped yet, so a
    checkpoint can be loaded into it in place."""
    state = optimizer.state[p]
    if not state:
        step_device = p.device if optimizer.defaults.get("fused") else "cpu"  # where AdamW itself keeps it
        state.update(
            step=torch.zeros((), dtype=torch.float32, device=step_device),
            exp_avg=torch.zeros_like(p),
            exp_avg_sq=torch.zeros_like(p),
        )
    return state


@torch.no_grad()
def load_adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, saved: dict) -> None:
    """Copy a saved AdamW state into ``p``'s (a no-op where DCP already loaded it in place)."""
    state = adamw_state(optimizer, p)
    for name, value in saved.items():
        if value is not state[name]:
            state[name].copy_(value)
