"""Vocab-parallel cross entropy (Megatron style) for logits sharded over the vocabulary.

``tp_loss(logits, targets)`` returns the same mean cross entropy as
``foldtrain.model.gpt.lm_loss`` (``F.cross_entropy`` over float logits, ``ignore_index=-100``;
float64 logits are kept in float64 by the vocab-parallel path),
whether ``logits`` is a plain tensor (tp = 1) or a DTensor sharded over its last dim on a
1-D tensor-parallel mesh (what ``apply_tensor_parallel`` makes the head return). The full
logits are never gathered: each rank works on its vocab slice with three all-reduces over
rows only (max, sum of exp, target logit); the backward (softmax - one_hot on the local
slice) needs no communication. The returned loss is a plain scalar tensor, identical on every
rank of the TP group, and ``loss.backward()`` can be called anywhere (unlike
``torch.distributed.tensor.parallel.loss_parallel``, whose backward must also run inside the
context manager).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foldtrain import collectives

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy of a (N, V_local) float vocab slice starting at ``vocab_start``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:  # type: ignore[override]
        n_local = logits.shape[-1]
        local_t = targets - vocab_start
        outside = (local_t < 0) | (local_t >= n_local)  # also true for ignore_index rows
        local_t = local_t.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)

        row_max = logits.max(dim=-1).values
        collectives.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = logits - row_max.unsqueeze(-1)  # the one slice-sized tensor: exponentiated and normalised in place
        exp.exp_()
        sum_exp = exp.sum(dim=-1)
        collectives.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        target_logit = (target_logit - row_max).masked_fill(outside, 0.0)
        collectives.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)

        loss = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax of the local slice
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        # softmax - one_hot, in the saved softmax's own memory (as Megatron's): this backward runs once
        grad, local_t, outside = ctx.saved_tensors
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean CE from a vocab slice ``local_logits`` (..., V_local) of the full logits; ``targets`` hold global ids."""
    # float32 at least, as lm_loss does (float64 logits stay float64)
    flat = local_logits.to(torch.promote_types(local_logits.dtype, torch.float32)).reshape(-1, local_logits.shape[-1])
    t = targets.reshape(-1).to(flat.device)
    per_row = _VocabParallelCrossEntropy.apply(flat, t, vocab_start, group)
    valid = t != ignore_index
    # same reduction as F.cross_entropy(reduction="mean"): mean over non-ignored rows (nan if none)
    return per_row.masked_fill(~valid, 0.0).sum() / valid.sum()


def tp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; vocab-parallel when ``logits`` is a vocab-sharded DTensor."""
    from foldtrain.model.gpt import lm_loss

    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - very old torch
        return lm_loss(logits, targets)
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    if not isinstance(logits, DTensor):
        return lm_loss(logits, targets)
    mesh, placements = logits.device_mesh, logits.placements
    if all(p.is_replicate() for p in placements):
        return lm_loss(logits.to_local(), targets)
    vocab_dim = logits.ndim - 1
    if mesh.ndim == 1 and isinstance(placements[0], Shard) and placements[0].dim in (vocab_dim, -1):
        vocab = logits.shape[-1]
        n = mesh.size()
        chunk = -(-vocab // n)  # DTensor's Shard splits like torch.chunk: ceil-sized pieces first
        start = mesh.get_local_rank() * chunk
        local = logits.to_local()
        assert start + local.shape[-1] <= vocab, (start, local.shape, vocab)
        return vocab_parallel_cross_entropy(local, targets, start, mesh.get_group())
    # any other layout (e.g. sharded over batch/sequence): correct but gathers the logits
    return lm_loss(logits.full_tensor(), targets)
