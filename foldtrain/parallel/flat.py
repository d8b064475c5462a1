"""Flat buffers: many tensors packed into one 1-D tensor for a single collective, and back."""

from __future__ import annotations

import torch


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype, size: int | None = None) -> torch.Tensor:
    """``tensors`` concatenated into one 1-D buffer of ``dtype``, zero-padded to ``size``."""
    parts = [t.detach().reshape(-1).to(dtype) for t in tensors]
    used = sum(p.numel() for p in parts)
    if size is not None and size > used:
        parts.append(torch.zeros(size - used, dtype=dtype, device=parts[0].device if parts else None))
    return torch.cat(parts)


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (casting to their dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
