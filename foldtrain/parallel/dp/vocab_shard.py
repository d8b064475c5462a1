"""``--dp.shard_vocab`` (fsdp): the tied embedding and output layer split over the data-parallel ranks by
vocabulary rows and never gathered.

FSDP2 keeps the tied weight in the root's unit: gathered whole at the forward's start and end, and through the
head's and the embedding's backward, beside three copies of its gradient. At GPT-2's vocabulary that unit is 5.6
transformer blocks. Here each rank keeps the rows FSDP2 would give it (``Shard(0)`` over the dp mesh, split as
``torch.chunk`` splits) and the activations travel instead, as in Megatron's vocabulary-parallel layers, but over
the data-parallel ranks, which hold different rows of the batch:

* embedding: every rank's token ids are all-gathered; each rank looks up the ids of its slice (zeros for the
  others) and the N partial sums are reduce-scattered, so each rank gets its own rows' embeddings. Backward: the
  embeddings' gradients are all-gathered and each rank accumulates the rows of its slice;
* head: the final hidden states are all-gathered, each rank computes the logits of its slice for every rank's
  rows, and the cross entropy is vocabulary-parallel (:mod:`foldtrain.parallel.tp_loss`). Backward: the hidden
  states' partial gradients are reduce-scattered.

The loss every rank backpropagates is the global batch's mean, so each slice's gradient is already the global
one (nothing to reduce), and each rank's hidden-state gradients are 1/N of its own rows' mean loss: the blocks'
reduce-scatters sum instead of averaging (``set_gradient_divide_factor(1)``).

Per step a rank sends a few times the activations (N x B x T x d) instead of three times the weight (V x d).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from foldtrain import collectives
from foldtrain.model.presets import vocab_slice
from foldtrain.parallel.scatter import exchange_rows, uses_all_to_all
from foldtrain.parallel.tp_loss import vocab_parallel_cross_entropy


def gather_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(B, ...) on each rank -> (W*B, ...): every rank's rows, in rank order."""
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather_single(out, x.contiguous(), group=group)
    return out


def scatter_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(W*B, ...) partial sums on each rank -> (B, ...): this rank's rows summed over ranks, by the backend's best
    reduce-scatter (:func:`foldtrain.parallel.scatter.exchange_rows`: on gloo an all-to-all and a local sum)."""
    work, buf, summed = exchange_rows(x.contiguous().view(world, -1), uses_all_to_all("auto"), group=group)
    work.wait()
    return (buf if summed else buf.sum(0)).view(x.shape[0] // world, *x.shape[1:])


class _Rows(torch.autograd.Function):
    """``gather_rows`` (``gather``) or ``scatter_rows``, whose backward is the other: the gradient of gathered rows
    is summed back to each rank's rows, that of summed rows is every rank's."""

    @staticmethod
    def forward(ctx, x, group, world, gather: bool):  # type: ignore[override]
        ctx.group, ctx.world, ctx.gather = group, world, gather
        return (gather_rows if gather else scatter_rows)(x, group, world)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (scatter_rows if ctx.gather else gather_rows)(grad, ctx.group, ctx.world), None, None, None


class SharedSlice:
    """What the embedding and the head share: the weight (a ``Shard(0)`` DTensor parameter), this rank's first row,
    the group, the compute dtype (``param_dtype``: the master precisions') and, within one forward and backward, the
    local slice and its gradient.

    The slice's gradient exists once. The embedding takes the local slice and the head reuses it (``pending``); the
    head's backward leaves its weight gradient here (``grad``) instead of returning it, and the embedding's backward,
    which comes after it, adds its rows into it in place and returns the sum. Autograd would add the two uses'
    gradients out of place: three slice-sized tensors at once."""

    def __init__(self, weight: nn.Parameter, start: int, group, world: int, param_dtype: torch.dtype | None):
        self.weight, self.start, self.group, self.world, self.param_dtype = weight, start, group, world, param_dtype
        self.pending: torch.Tensor | None = None  # the embedding's local slice, for this forward's head
        self.grad: torch.Tensor | None = None  # the head's weight gradient, for the embedding's backward

    def local(self) -> torch.Tensor:
        w = self.weight.to_local()
        return w if self.param_dtype is None else w.to(self.param_dtype)


class _Lookup(torch.autograd.Function):
    """Rows ``ids`` of the local slice ``w`` (zeros where ``outside``); backward: ``index_add_`` of the rows'
    gradients into the head's weight gradient, if it left one."""

    @staticmethod
    def forward(ctx, ids, outside, w, shared):  # type: ignore[override]
        ctx.save_for_backward(ids, outside)
        ctx.shared, ctx.shape = shared, w.shape
        return F.embedding(ids, w).masked_fill(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ids, outside = ctx.saved_tensors
        acc, ctx.shared.grad = ctx.shared.grad, None
        if acc is None:
            acc = grad.new_zeros(ctx.shape)
        rows = grad.masked_fill(outside.unsqueeze(-1), 0.0).reshape(-1, ctx.shape[1])
        return None, None, acc.index_add_(0, ids.reshape(-1), rows.to(acc.dtype)), None


class _Project(torch.autograd.Function):
    """``x @ w.T``; backward: with ``hand_over`` the weight's gradient goes to ``shared.grad`` for the embedding's
    backward to complete and return (``_Lookup``), else it is returned. Computed in the incoming gradient's dtype
    (autocast's), returned in each input's."""

    @staticmethod
    def forward(ctx, x, w, shared, hand_over):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.shared, ctx.hand_over = shared, hand_over
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_w = g.t().mm(x.reshape(-1, x.shape[-1]).to(g.dtype)).to(w.dtype)
        grad_x = grad.matmul(w.to(grad.dtype)).to(x.dtype)
        if ctx.hand_over:
            ctx.shared.grad = grad_w
            return grad_x, None, None, None
        return grad_x, grad_w, None, None


class _VocabSlice(nn.Module):
    def __init__(self, shared: SharedSlice):
        super().__init__()
        self.shared = shared
        self.weight = shared.weight  # registered here, so the parameter keeps the plain model's name


class VocabShardedEmbedding(_VocabSlice):
    """``nn.Embedding`` over a vocabulary slice: (B, T) ids -> (B, T, d), this rank's rows."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        sh = self.shared
        w = sh.pending = sh.local()
        ids = gather_rows(idx, sh.group, sh.world) - sh.start
        outside = (ids < 0) | (ids >= w.shape[0])
        partial = _Lookup.apply(ids.masked_fill(outside, 0), outside, w, sh)
        return _Rows.apply(partial, sh.group, sh.world, False)


class VocabShardedHead(_VocabSlice):
    """The output projection over a vocabulary slice: (B, T, d) -> (W*B, T, rows of the slice), the logits of every
    rank's rows; the padding rows past ``vocab_size`` get -inf. :meth:`loss` takes them."""

    def __init__(self, shared: SharedSlice, vocab_size: int):
        super().__init__(shared)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh = self.shared
        w, sh.pending = sh.pending, None  # not held past the forward
        tied = w is not None and torch.is_grad_enabled()  # the embedding's backward will come after this one's
        w = w if w is not None else sh.local()
        logits = _Project.apply(_Rows.apply(x, sh.group, sh.world, True), w, sh, tied)
        real = self.vocab_size - sh.start  # rows of this slice that are words, not padding
        if real >= w.shape[0]:
            return logits
        padding = torch.arange(w.shape[0], device=logits.device) >= real
        return logits.masked_fill(padding, float("-inf"))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy over every rank's rows (the same on every rank)."""
        sh = self.shared
        every_target = gather_rows(targets.to(logits.device), sh.group, sh.world)
        return vocab_parallel_cross_entropy(logits, every_target, sh.start, sh.group)


def shard_vocab(model: nn.Module, mesh, param_dtype: torch.dtype | None) -> nn.Parameter:
    """Replace ``model``'s tied ``wte`` and ``lm_head`` (a whole GPT, identical on every rank) by their vocabulary
    slices over the 1-D ``mesh``; returns the one sharded parameter, under the plain model's names."""
    from torch.distributed.tensor import DTensor, Shard

    wte, head = model.embedding.wte, model.head
    full = wte.weight
    assert head.lm_head.weight is full, "shard_vocab needs the tied embedding and output layer"
    world, rank = mesh.size(), mesh.get_local_rank()
    start, count = vocab_slice(full.shape[0], world, rank)
    local = full.detach()[start : start + count].clone()
    weight = nn.Parameter(
        DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    )
    shared = SharedSlice(weight, start, mesh.get_group(), world, param_dtype)
    model.embedding.wte = VocabShardedEmbedding(shared)
    head.lm_head = VocabShardedHead(shared, vocab_size=model.shape.vocab_size)
    head.padding_mask = nn.Identity()  # the sharded head masks its own slice's padding
    return weight
