"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings.

The model knows nothing about parallelism. It is an ordered list of parts
(``model.parts``): the embedding, ``n_layer`` blocks and the head (final
LayerNorm + tied output projection), each a module mapping one tensor to the
next, so pipeline parallelism can slice it into chunks and tensor parallelism
can rewrite its linears from outside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from foldtrain.model.init import init_weights
from foldtrain.model.presets import padded_vocab


@dataclass(frozen=True)
class GPTShape:
    n_layer: int
    n_head: int
    d_model: int
    context: int
    vocab_size: int
    dropout: float = 0.0
    # rows of the embedding and the output layer when padded beyond vocab_size (0: not padded); the
    # padding rows never take probability (their logits are -inf) and never leave the process in an export
    padded_vocab: int = 0

    @classmethod
    def from_config(cls, m, tp: int = 1) -> GPTShape:
        """The shape of ``--model.*``, the vocabulary padded to a multiple of --model.vocab_multiple and of tp."""
        rows = padded_vocab(m.vocab_size, getattr(m, "vocab_multiple", 1), tp)
        pad = rows if rows > m.vocab_size else 0
        return cls(m.n_layer, m.n_head, m.d_model, m.context, m.vocab_size, m.dropout, pad)

    @property
    def embedding_rows(self) -> int:
        return self.padded_vocab or self.vocab_size


class _RowsLookup(torch.autograd.Function):
    """``F.embedding`` whose weight gradient, once the weight's ``.grad`` exists, is the looked-up rows: a sparse
    tensor that autograd's accumulation adds into the dense ``.grad`` in place, row by row. (So
    ``torch.autograd.grad`` asked for the weight then returns that sparse tensor: nothing in foldtrain asks.)"""

    @staticmethod
    def forward(ctx, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.weight = weight  # an input, not an output: no reference cycle
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (idx,) = ctx.saved_tensors
        w = ctx.weight
        if w.grad is None or w.grad.layout != torch.strided:  # this gradient becomes .grad: torch's dense one
            return None, torch.ops.aten.embedding_dense_backward(grad, idx, w.shape[0], -1, False)
        if not torch.sparse.check_sparse_tensor_invariants.is_enabled():
            # the default made explicit: torch 2.11 warns at a process's first sparse tensor otherwise
            torch.sparse.check_sparse_tensor_invariants.disable()
        rows = grad.reshape(-1, w.shape[1])
        return None, torch.sparse_coo_tensor(idx.reshape(1, -1), rows, w.shape, check_invariants=False)


_WIDE = (torch.float32, torch.float64)  # weights whose gradient the row backward adds to row by row


class RowEmbedding(nn.Embedding):
    """``nn.Embedding`` whose backward adds only the rows it looked up to an existing gradient, on the CPU.

    The stock backward builds a dense (rows, d) gradient for every micro-batch and autograd then adds it to
    ``.grad``: three passes over the whole table for the few rows a micro-batch reads. On a CPU that is
    most of the embedding segment's backward (3-6 ms a micro-batch for 8,192 x 256 rows on a few GB/s),
    on the critical path of every pipeline schedule, where the table's segment runs the step's last backward.
    Accelerators keep the stock backward: the pass costs them little, and their sparse addition is atomic
    adds (a run-to-run varying sum). So do a weight that is not a plain tensor (tensor parallelism's DTensor)
    and half-precision weights (``--precision bf16-master``): adding each token's row to a large ``.grad``
    one at a time would round most of it away in bf16, where the stock backward sums a micro-batch's rows
    first. The gradient is the same sum in another order (fp32 rounding apart)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if type(w) is nn.Parameter and w.device.type == "cpu" and w.dtype in _WIDE and not self._options():
            return _RowsLookup.apply(idx, w)
        return super().forward(idx)

    def _options(self) -> bool:
        """Whether an option of ``nn.Embedding`` that the row lookup does not implement is set."""
        return self.padding_idx is not None or self.max_norm is not None or self.scale_grad_by_freq or self.sparse


class Embedding(nn.Module):
    """Token + learned position embeddings: (B, T) token ids -> (B, T, d) hidden states."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.wte = RowEmbedding(s.embedding_rows, s.d_model)
        self.wte.vocab_rows = s.vocab_size  # rows past it are padding: initialised to zero
        self.wpe = RowEmbedding(s.context, s.d_model)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Attention(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.n_head = s.n_head
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model)
        self.proj = nn.Linear(s.d_model, s.d_model)
        self.dropout = s.dropout
        self.resid_drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)
        # qkv's output features are laid out head-major ([head][q|k|v][head_dim]), so a column-parallel
        # split of qkv gives each rank whole heads; the head count is read from the local width.
        head_dim = x.shape[-1] // self.n_head
        n_head = qkv.shape[-1] // (3 * head_dim)
        q, k, v = qkv.view(B, T, n_head, 3, head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.fc = nn.Linear(s.d_model, 4 * s.d_model)
        self.proj = nn.Linear(4 * s.d_model, s.d_model)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.ln1 = nn.LayerNorm(s.d_model)
        self.attn = Attention(s)
        self.ln2 = nn.LayerNorm(s.d_model)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PaddingMask(nn.Module):
    """Sets the logits of the padding rows (ids >= ``vocab_size``) to -inf, so they take no probability
    and get no gradient. Tensor parallelism swaps it for a version that masks its local vocabulary slice."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill(ids >= self.vocab_size, float("-inf"))


class Head(nn.Module):
    """Final LayerNorm and the output projection (its weight tied to the token embedding)."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.ln_f = nn.LayerNorm(s.d_model)
        self.lm_head = nn.Linear(s.d_model, s.embedding_rows, bias=False)
        self.lm_head.vocab_rows = s.vocab_size
        self.padding_mask = PaddingMask(s.vocab_size) if s.padded_vocab else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.padding_mask(self.lm_head(self.ln_f(x)))


class GPT(nn.Module):
    """The model, initialised from ``seed`` (:mod:`foldtrain.model.init`: each parameter from its own
    generator). Built under ``torch.device("meta")`` it holds no memory and is left uninitialised:
    whoever materialises a part of it calls ``init_weights(part, model.init_seed, n_layer)``."""

    def __init__(self, shape: GPTShape, seed: int = 0):
        super().__init__()
        self.shape = shape
        self.init_seed = seed
        self.parts = nn.ModuleList([Embedding(shape), *[Block(shape) for _ in range(shape.n_layer)], Head(shape)])
        self.head.lm_head.weight = self.embedding.wte.weight  # tied
        if not self.embedding.wte.weight.is_meta:
            init_weights(self, seed, shape.n_layer)

    @property
    def embedding(self) -> Embedding:
        return self.parts[0]

    @property
    def blocks(self) -> list[Block]:
        return list(self.parts[1:-1])

    @property
    def head(self) -> Head:
        return self.parts[-1]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab), or the mean cross-entropy when ``targets`` are given."""
        x = idx
        for part in self.parts:
            x = part(x)
        if targets is None:
            return x
        return lm_loss(x, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
