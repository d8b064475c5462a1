"""AdamW as foldtrain uses it: weight decay on matrices only, and in-place access to a parameter's state
(for engines that save or load optimizer state under their own keys)."""

from __future__ import annotations

import torch
import torch.nn as nn


def build_optimizer(params_named: list[tuple[str, nn.Parameter]], optim_cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, LayerNorms); order follows the model."""
    decay = [p for _, p in params_named if p.dim() >= 2]
    no_decay = [p for _, p in params_named if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, foreach=True)


def adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``p``'s AdamW state, created (zero moments, step 0) if the optimizer has not stepped yet, so a
    checkpoint can be loaded into it in place."""
    state = optimizer.state[p]
    if not state:
        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    return state


@torch.no_grad()
def load_adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, saved: dict) -> None:
    """Copy a saved AdamW state into ``p``'s (a no-op where DCP already loaded it in place)."""
    state = adamw_state(optimizer, p)
    for name, value in saved.items():
        if value is not state[name]:
            state[name].copy_(value)
