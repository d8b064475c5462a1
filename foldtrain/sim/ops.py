"""The operations of one training step, one by one: what each computes or moves, on one tensor-parallel rank.

This is the per-operation description the cost model prices (:mod:`.costs`) and ``foldtrain calibrate
--device cuda`` measures: the matrix products at their ``(M, N, K)`` shapes, attention at its
``(batch, heads, seq, head_dim)``, and the memory-bound kernels by the bytes they read and write. A GPT-2
block (pre-norm, fused attention, GELU MLP; foldtrain's :mod:`foldtrain.model.gpt`), with Megatron's
tensor parallelism (columns of qkv and fc, rows of proj and fc2; ``t`` ranks) and, for runs of other systems,
their variants: attention as two batched products around a fused softmax (``attention="unfused"``),
dropout, and sequence parallelism (the norms, dropouts and residuals split over the ``t`` ranks).

Byte counts are reads + writes of the kernel, activations at ``e`` bytes per element; FLOPs are
multiply-adds x 2. Causal fused attention skips the masked half; the unfused form computes all of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # "gemm" | "attention" | "norm" | "gelu" | "softmax" | "elem"
    flops: float = 0.0
    bytes: float = 0.0
    shape: tuple = ()  # gemm: (M, N, K); attention: (batch, heads, seq, head_dim)
    kernels: int = 1
    batch: int = 1  # gemm: independent products of that shape (the unfused attention's heads)


@dataclass(frozen=True)
class BlockShape:
    """One tensor-parallel rank's view of a block pass: ``b`` sequences of ``L`` tokens."""

    b: int
    L: int
    d: int
    heads: int
    t: int = 1
    e: int = 2  # bytes per activation element
    ffn: int = 0  # hidden width of the MLP (0: 4 d)
    attention: str = "flash"  # "flash" (one fused kernel) or "unfused" (two products around a softmax)
    dropout: bool = False
    seq_parallel: bool = False

    @property
    def tokens(self) -> int:
        return self.b * self.L

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.d

    @property
    def local_heads(self) -> int:
        return max(1, self.heads // self.t)

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    @property
    def split(self) -> int:
        """Ranks the norm, dropout and residual work is split over (sequence parallelism)."""
        return self.t if self.seq_parallel else 1


def gemm(name: str, m: int, n: int, k: int, batch: int = 1) -> Op:
    return Op(name, "gemm", flops=2.0 * m * n * k * batch, shape=(int(m), int(n), int(k)), batch=batch)


def linear_forward(s: BlockShape) -> list[Op]:
    T, d, f, t = s.tokens, s.d, s.f, s.t
    return [
        gemm("qkv", T, 3 * d // t, d),
        gemm("proj", T, d, d // t),
        gemm("fc", T, f // t, d),
        gemm("fc2", T, d, f // t),
    ]


def linear_backward(s: BlockShape) -> list[Op]:
    """Each product ``y = x W`` of shape (M, N, K) has two in the backward: ``dx = dy W^T`` (M, K, N) and
    ``dW = x^T dy`` (K, N, M) (the weight's gradient, accumulated over micro-batches in place)."""
    out = []
    for op in linear_forward(s):
        m, n, k = op.shape
        out += [gemm(op.name + ".dgrad", m, k, n), gemm(op.name + ".wgrad", k, n, m)]
    return out


def attention_forward(s: BlockShape) -> list[Op]:
    b, h, L, hd, e = s.b, s.local_heads, s.L, s.head_dim, s.e
    if s.attention == "flash":
        return [Op("attention", "attention", flops=2.0 * b * h * L * L * hd, shape=(b, h, L, hd))]
    scores = b * h * L * L
    ops = [gemm("scores", L, L, hd, batch=b * h), Op("softmax", "softmax", bytes=2.0 * scores * e)]
    if s.dropout:
        ops.append(Op("attn_dropout", "elem", bytes=scores * (2.0 * e + 1)))
    return ops + [gemm("context", L, hd, L, batch=b * h)]


def attention_backward(s: BlockShape) -> list[Op]:
    """Fused: the backward recomputes the scores and runs four more products (2.5 times the forward's
    FLOPs). Unfused: each batched product has two, the softmax's backward reads its output and gradient."""
    b, h, L, hd, e = s.b, s.local_heads, s.L, s.head_dim, s.e
    if s.attention == "flash":
        return [Op("attention.bwd", "attention", flops=5.0 * b * h * L * L * hd, shape=(b, h, L, hd))]
    scores = b * h * L * L
    ops = [gemm("context.dgrad", L, L, hd, batch=b * h), gemm("context.wgrad", hd, L, L, batch=b * h)]
    if s.dropout:
        ops.append(Op("attn_dropout.bwd", "elem", bytes=scores * (2.0 * e + 1)))
    ops.append(Op("softmax.bwd", "softmax", bytes=3.0 * scores * e))
    return ops + [gemm("scores.dgrad", L, hd, L, batch=b * h), gemm("scores.wgrad", L, hd, L, batch=b * h)]


def memory_forward(s: BlockShape) -> list[Op]:
    """Two norms, the GELU, two residual adds (and two dropouts): read and write their tensors once."""
    T, d, e, f, t = s.tokens, s.d, s.e, s.f, s.t
    act = T * d * e / s.split
    ops = [
        Op("ln1", "norm", bytes=2 * act),
        Op("ln2", "norm", bytes=2 * act),
        Op("gelu", "gelu", bytes=2 * T * f * e / t),
    ]
    ops += [Op("residual1", "elem", bytes=3 * act), Op("residual2", "elem", bytes=3 * act)]
    if s.dropout:
        mask = T * d / s.split
        ops += [Op("dropout1", "elem", bytes=2 * act + mask), Op("dropout2", "elem", bytes=2 * act + mask)]
    return ops


def memory_backward(s: BlockShape) -> list[Op]:
    """A norm's backward reads its input and output gradient and writes the input gradient (and reduces the
    weight's); the GELU's reads input and gradient; the residual stream adds the branch's gradient."""
    T, d, e, f, t = s.tokens, s.d, s.e, s.f, s.t
    act = T * d * e / s.split
    ops = [
        Op("ln1.bwd", "norm", bytes=3 * act, kernels=2),
        Op("ln2.bwd", "norm", bytes=3 * act, kernels=2),
        Op("gelu.bwd", "gelu", bytes=3 * T * f * e / t),
        Op("residual1.bwd", "elem", bytes=3 * act),
        Op("residual2.bwd", "elem", bytes=3 * act),
    ]
    if s.dropout:
        mask = T * d / s.split
        ops += [Op("dropout1.bwd", "elem", bytes=act + mask + act), Op("dropout2.bwd", "elem", bytes=2 * act + mask)]
    return ops


def block_forward(s: BlockShape) -> list[Op]:
    """A block's forward (the order of the list is not the kernels' order: costs add up)."""
    return linear_forward(s) + attention_forward(s) + memory_forward(s)


def block_backward(s: BlockShape) -> list[Op]:
    return linear_backward(s) + attention_backward(s) + memory_backward(s)


def head_ops(s: BlockShape, vocab: int) -> list[Op]:
    """The fused head, forward and backward in one pass: the final norm, the output projection (``V / t``
    columns) and its two backward products, and the fp32 loss (log-softmax and its gradient over the logits,
    read and written in each of the head's three passes: 24 bytes a logit)."""
    T, d, e = s.tokens, s.d, s.e
    cols = vocab // s.t
    act = T * d * e / s.split
    return [
        Op("ln_f", "norm", bytes=2 * act),
        gemm("lm_head", T, cols, d),
        Op("cross_entropy", "softmax", bytes=24.0 * T * cols, kernels=4),
        gemm("lm_head.dgrad", T, d, cols),
        gemm("lm_head.wgrad", cols, d, T),
        Op("ln_f.bwd", "norm", bytes=3 * act, kernels=2),
    ]


def gemm_shapes(s: BlockShape, vocab: int) -> list[tuple[int, int, int]]:
    """Every distinct ``(M, N, K)`` a step of this shape multiplies (blocks, attention's products when unfused,
    the head), forward and backward: what ``calibrate --device cuda`` measures."""
    ops = block_forward(s) + block_backward(s) + head_ops(s, vocab)
    return sorted({op.shape for op in ops if op.kind == "gemm"})


def attention_shape(s: BlockShape) -> tuple[int, int, int, int]:
    return (s.b, s.local_heads, s.L, s.head_dim)
