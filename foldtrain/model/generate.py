"""Autoregressive sampling with temperature and top-k."""

from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def sample(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    context: int,
    temperature: float = 0.8,
    top_k: int = 50,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; the window is cropped to ``context``."""
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(idx[:, -context:])
        if hasattr(logits, "full_tensor"):  # vocab-sharded logits of a tensor-parallel model
            logits = logits.full_tensor()
        logits = logits[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return idx
