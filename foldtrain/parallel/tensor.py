"""Megatron-style tensor parallelism for the GPT parts, applied from outside with PyTorch DTensor.

``apply_tensor_parallel(module, tp_mesh)`` rewrites, in place, every ``Embedding``, ``Block`` and
``Head`` found inside ``module`` (a whole ``GPT`` or a pipeline chunk holding a contiguous slice of
``model.parts``) with ``torch.distributed.tensor.parallel.parallelize_module``:

* Block: ``attn.qkv`` and ``mlp.fc`` column-parallel (each rank keeps whole heads / a slice of the
  MLP width as plain local tensors), ``attn.proj`` and ``mlp.proj`` row-parallel (partial sums are
  all-reduced, the output is a plain replicated tensor). One all-reduce per sub-layer forward, one
  per sub-layer backward (where the column-parallel input is turned back into a replicated
  gradient), as in Megatron.
* Embedding: ``wte`` vocab-parallel (``RowwiseParallel`` on ``nn.Embedding``: weight ``Shard(0)``,
  out-of-slice ids give zeros, output all-reduced); ``wpe`` replicated.
* Head: ``ln_f`` replicated; ``lm_head`` column-parallel over the vocab with its output kept as a
  DTensor ``Shard(-1)``: the logits stay sharded over the vocabulary. Use ``tp_loss`` (vocab-parallel
  cross entropy, in ``foldtrain.parallel.tp_loss``) on them, never ``lm_loss`` (which would gather
  them). Code that needs full logits (sampling) calls ``logits.full_tensor()``.

Every parameter of the rewritten parts becomes a DTensor on ``tp_mesh``: the split weights are
``Shard``, everything else (LayerNorms, ``wpe``, biases of row-parallel linears) is ``Replicate``
(computed redundantly, its gradient identical on every TP rank because the inputs and output
gradients of those modules are replicated). Keeping *all* parameters DTensors, rather than leaving
the replicated ones as plain tensors, lets the optimizer's and the clipping's ``_foreach_*`` kernels
see homogeneous lists (DTensor refuses "mixed torch.Tensor and DTensor" arguments).

Tied weights: ``wte.weight`` and ``lm_head.weight`` are both (vocab, d_model) sharded on dim 0
(``Shard(0)``), so each rank's vocab slice of the embedding is exactly its slice of the output
projection. ``parallelize_module`` replaces parameters module by module, which would untie them;
when ``module`` holds both and they were the same ``Parameter`` before, ``lm_head.weight`` is
re-pointed at the new sharded ``wte.weight`` afterwards, so they stay ONE parameter (one gradient
accumulating both uses, one optimizer state). A pipeline chunk holding only one of them just has that
one sharded; the cross-stage tie is the pipeline's business.

Loss: ``lm_loss`` (and so ``GPT.forward(idx, targets)``) raises on the sharded logits ("mixed
torch.Tensor and DTensor"); training code calls ``tp_loss(model(idx), targets)``, which equals
``lm_loss`` on plain logits too, so it can be used unconditionally.

Gradient norm: ``torch.nn.utils.get_total_norm`` / ``clip_grads_with_norm_`` / ``clip_grad_norm_``
(foreach or not) work on the all-DTensor gradients and give the global norm, as a ``Replicate``
DTensor (DTensor reduces the per-shard norms; ``float(norm)`` works), so ``Engine.clip`` runs
unchanged. ``grad_norm`` below returns the same global norm as a plain tensor with ONE all-reduce
per mesh (sharded gradients summed over the TP group, replicated ones counted once) and
``clip_grad_norm_`` clips with it. For loss scaling, ``grads_finite`` replaces the plain
``flag &= torch.isfinite(g).all()`` (which fails on DTensors) and makes all TP ranks agree.

Checkpoints: ``model.state_dict()`` / ``get_model_state_dict`` hold DTensors under the same names
as the plain model; ``torch.distributed.checkpoint`` saves them sharded and loads them into any
other layout, including a single-process plain ``GPT`` (DCP reshards).

Vocabulary: the trainer builds the model with its vocabulary padded to a multiple of tp
(``GPTShape.from_config(model_config, tp)``); the head's ``PaddingMask`` is swapped for one that sets
the padding ids of this rank's vocabulary slice to -inf, so they take no probability and no gradient.

Dropout: the dropouts after replicated activations must draw the same mask on every TP rank, so TP
ranks must share their RNG seed (attention-probability dropout then uses the same stream on every
rank's heads, which is harmless).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from foldtrain.model.gpt import PaddingMask
from foldtrain.schedules.layout import check_tp

__all__ = [
    "apply_tensor_parallel",
    "check_tp",
    "tp_loss",
    "grad_norm",
    "clip_grad_norm_",
    "grads_finite",
    "is_tensor_parallel",
]


# --------------------------------------------------------------------------- validation (torch-free)
def tp_loss(logits, targets):
    """Mean cross entropy, vocab-parallel on vocab-sharded DTensor logits (see ``foldtrain.parallel.tp_loss``)."""
    from foldtrain.parallel.tp_loss import tp_loss as _tp_loss

    return _tp_loss(logits, targets)


# --------------------------------------------------------------------------- applying TP
def _replicate(module, mesh) -> None:
    """Make every parameter of ``module`` a Replicate DTensor; it runs on plain tensors in and out."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(mod, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x
            for x in inputs
        )

    def to_local(mod, outputs, device_mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    distribute_module(module, mesh, partition_fn=None, input_fn=to_dtensor, output_fn=to_local)


class _ShardedPaddingMask(nn.Module):
    """``PaddingMask`` for vocab-sharded DTensor logits: each rank masks the padding ids in its own slice."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits):
        from torch.distributed.tensor import DTensor

        local = logits.to_local()
        start = logits.device_mesh.get_local_rank() * local.shape[-1]  # the rows divide evenly over tp
        ids = torch.arange(start, start + local.shape[-1], device=local.device)
        masked = local.masked_fill(ids >= self.vocab_size, float("-inf"))
        return DTensor.from_local(
            masked, logits.device_mesh, logits.placements, run_check=False, shape=logits.shape, stride=logits.stride()
        )


def _check_not_applied(module) -> None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError("apply_tensor_parallel: the module already holds DTensor parameters (applied twice?)")


def apply_tensor_parallel(module, tp_mesh):
    """Shard the GPT parts inside ``module`` over the 1-D ``tp_mesh`` (in place); returns ``module``.

    ``module`` may be a whole ``GPT`` or any module/ModuleList holding some of its parts (a pipeline
    chunk). Call it on every rank of the TP group with identically initialised weights (the shards
    are cut from rank 0's copy). With a mesh of size 1 the module is returned unchanged.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from foldtrain.model.gpt import Block, Embedding, Head

    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D")
    tp = tp_mesh.size()
    if tp == 1:
        return module
    embeddings = [m for m in module.modules() if isinstance(m, Embedding)]
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    heads = [m for m in module.modules() if isinstance(m, Head)]
    if not (embeddings or blocks or heads):
        raise ValueError(f"apply_tensor_parallel: no GPT Embedding/Block/Head inside {type(module).__name__}")
    _check_not_applied(module)
    for b in blocks:
        d = b.attn.qkv.in_features
        check_tp(b.attn.n_head, d, tp, tp)
    for e in embeddings:
        check_tp(tp, e.wte.embedding_dim, e.wte.num_embeddings, tp)
    for h in heads:
        check_tp(tp, h.lm_head.in_features, h.lm_head.out_features, tp)

    ties = [(e, h) for e in embeddings for h in heads if h.lm_head.weight is e.wte.weight]

    for e in embeddings:
        # vocab-sharded, output all-reduced; input_layouts=Replicate(): the token ids are the same on every
        # rank (RowwiseParallel's default Shard(-1) would all-gather them along the sequence)
        parallelize_module(e, tp_mesh, {"wte": RowwiseParallel(input_layouts=Replicate())})
        _replicate(e.wpe, tp_mesh)
    for b in blocks:
        parallelize_module(
            b,
            tp_mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
        _replicate(b.ln1, tp_mesh)
        _replicate(b.ln2, tp_mesh)
    for h in heads:
        parallelize_module(h, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        _replicate(h.ln_f, tp_mesh)
        if isinstance(h.padding_mask, PaddingMask):
            h.padding_mask = _ShardedPaddingMask(h.padding_mask.vocab_size)
    for e, h in ties:
        w = e.wte.weight
        assert h.lm_head.weight.placements == w.placements == (Shard(0),), (h.lm_head.weight.placements, w.placements)
        h.lm_head.weight = w  # re-tie: one sharded Parameter for both uses
    return module


def is_tensor_parallel(module) -> bool:
    """Whether ``module`` holds DTensor parameters (``apply_tensor_parallel`` was applied with tp > 1)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


# --------------------------------------------------------------------------- gradient norm / clipping
def grad_norm(params: Iterable, norm_type: float = 2.0):
    """Global gradient norm over the TP group, as a plain 0-dim tensor (same on every TP rank).

    Computed in float32 (float64 if a gradient is float64), like ``torch.nn.utils.get_total_norm``.

    Works on any mix of plain and DTensor gradients: a gradient sharded over a 1-D mesh contributes
    the sum of its shards (one all-reduce per mesh, not one per tensor), a replicated one (plain or
    ``Replicate``) counts once. Gradients in other layouts fall back to ``full_tensor()``.
    Data-parallel replicas are not summed (their gradients are equal after the DP sync); a pipeline
    combines the per-stage values itself (e.g. all-reduce ``grad_norm(...) ** 2`` over stages).
    """
    import functools
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from foldtrain import collectives

    p = float(norm_type)
    is_inf = math.isinf(p)
    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    first = grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]
    device = first.device
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads], torch.float32)  # fp32 at least

    def local_stat(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(dtype)
        if is_inf:
            return t.abs().max() if t.numel() else torch.zeros((), device=t.device)
        return torch.linalg.vector_norm(t, p) ** p

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if is_inf else a + b

    replicated = torch.zeros((), dtype=dtype, device=device)
    per_mesh: dict = {}
    for g in grads:
        if not isinstance(g, DTensor):
            replicated = combine(replicated, local_stat(g).to(device))
        elif all(pl.is_replicate() for pl in g.placements):
            replicated = combine(replicated, local_stat(g.to_local()).to(device))
        elif g.device_mesh.ndim == 1 and isinstance(g.placements[0], Shard):
            key = id(g.device_mesh)
            mesh, acc = per_mesh.get(key, (g.device_mesh, torch.zeros((), dtype=dtype, device=device)))
            per_mesh[key] = (mesh, combine(acc, local_stat(g.to_local()).to(device)))
        else:
            replicated = combine(replicated, local_stat(g.full_tensor()).to(device))
    total = replicated
    for mesh, acc in per_mesh.values():
        collectives.all_reduce(acc, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=mesh.get_group())
        total = combine(total, acc)
    return total if is_inf else total ** (1.0 / p)


def clip_grad_norm_(params: Iterable, max_norm: float, norm_type: float = 2.0):
    """Clip gradients in place to a global norm ``max_norm``; returns the norm before clipping (plain tensor)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [q for q in params if q.grad is not None]
    total = grad_norm(params, norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for q in params:
            g = q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
            g.mul_(coef.to(g.device, g.dtype))
    return total


def grads_finite(grads: Iterable) -> bool:
    """Whether every gradient is finite, agreed over the TP group (for loss-scaling overflow checks).

    A sharded gradient is checked on the local shard and the verdict is all-reduced (MIN) over its
    mesh, so every TP rank skips (or takes) the same step. Plain ``torch.isfinite(g).all()`` on a
    DTensor, combined with a plain flag, fails ("mixed torch.Tensor and DTensor").
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from foldtrain import collectives

    flag, meshes = None, {}
    for g in grads:
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if isinstance(g, DTensor) and not all(pl.is_replicate() for pl in g.placements):
            meshes[id(g.device_mesh)] = g.device_mesh
        ok = torch.isfinite(local).all()
        flag = ok if flag is None else flag & ok.to(flag.device)
    if flag is None:
        return True
    flag = flag.to(torch.int32)
    for mesh in meshes.values():
        for dim in range(mesh.ndim):
            collectives.all_reduce(flag, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    return bool(flag)
