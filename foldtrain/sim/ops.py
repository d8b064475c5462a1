"""The operations of one training step, one by one: what each computes or moves, on one tensor-parallel rank.

This is the per-operation description the cost model prices (:mod:`.costs`) and ``foldtrain calibrate
--device cuda`` measures: the matrix products at their ``(M, N, K)`` shapes, attention at its
``(batch, heads, seq, head_dim)``, and the memory-bound kernels by the bytes they read and write. A GPT-2
block (pre-norm, fused attention, GELU MLP; foldtrain's :mod:`foldtrain.model.gpt`), with Megatron's
tensor parallelism (columns of qkv and fc, rows of proj and fc2; ``t`` ranks) and, for runs of other systems,
their variants: attention as two batched products around a fused softmax (``attention="unfused"``),
dropout, and sequence parallelism (the norms, dropouts and residuals split over the ``t`` ranks).

Byte counts are reads + writes of the kernel, activations at ``e`` bytes per element; FLOPs are
multiply-adds x 2. Causal fused attention skips the masked half; the unfused form computes all of it. A
product's ``layout`` says which operand is stored transposed, as PyTorch runs a linear layer: the forward
``x W^T`` ("nt"), the input's gradient ``dy W`` ("nn"), the weight's ``x^T dy`` ("tn"); cuBLAS's speed
depends on it where a leading dimension is odd (an unpadded vocabulary).

``autocast`` (bf16 / fp16 autocast over fp32 weights, whoever's block: foldtrain's ``--precision bf16``, or
LLM Foundry's ``amp_bf16`` with FSDP's "DEFAULT" mixed precision) keeps an fp32 residual stream: the norms
read fp32 and their outputs are cast to the half type, each residual add reads the half branch and the fp32
stream, each weight is cast per pass and its gradient cast back. ``native`` adds what foldtrain's own block
runs beyond the textbook operations (other systems fuse or avoid them): the linear layers' biases, whose
gradients are reductions over the tokens; q, k and v as views of one product, whose gradients the backward
packs back (a stack and a copy).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # "gemm" | "attention" | "norm" | "gelu" | "softmax" | "cast" | "pack" | "reduce" | "elem"
    flops: float = 0.0
    bytes: float = 0.0
    shape: tuple = ()  # gemm: (M, N, K); attention: (batch, heads, seq, head_dim)
    kernels: int = 1
    batch: int = 1  # gemm: independent products of that shape (the unfused attention's heads)
    layout: str = "nn"  # gemm: "nt" (B stored transposed), "nn", "tn" (A stored transposed)
    weight_grad: bool = False  # part of the weights' gradients: a split backward's W, not its I

    @property
    def key(self) -> tuple:
        """What a measured table is keyed by: ``(M, N, K, layout)`` for a product, else the shape."""
        return (*self.shape, self.layout) if self.kind == "gemm" else self.shape


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
    native: bool = False  # foldtrain's own block (module docstring)
    autocast: bool = False  # bf16 / fp16 autocast over fp32 weights: an fp32 residual stream (module docstring)

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


def gemm(name: str, m: int, n: int, k: int, batch: int = 1, layout: str = "nn", weight_grad: bool = False) -> Op:
    flops = 2.0 * m * n * k * batch
    shape = (int(m), int(n), int(k))
    return Op(name, "gemm", flops=flops, shape=shape, batch=batch, layout=layout, weight_grad=weight_grad)


def linear_forward(s: BlockShape) -> list[Op]:
    T, d, f, t = s.tokens, s.d, s.f, s.t
    return [
        gemm("qkv", T, 3 * d // t, d, layout="nt"),
        gemm("proj", T, d, d // t, layout="nt"),
        gemm("fc", T, f // t, d, layout="nt"),
        gemm("fc2", T, d, f // t, layout="nt"),
    ]


def linear_backward(s: BlockShape) -> list[Op]:
    """Each product ``y = x W^T`` of shape (M, N, K) has two in the backward: ``dx = dy W`` (M, K, N) and
    ``dW^T = x^T dy`` (K, N, M) (the weight's gradient, accumulated over micro-batches in place)."""
    out = []
    for op in linear_forward(s):
        m, n, k = op.shape
        out += [
            gemm(op.name + ".dgrad", m, k, n, layout="nn"),
            gemm(op.name + ".wgrad", k, n, m, layout="tn", weight_grad=True),
        ]
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


def amp(s: BlockShape) -> bool:
    """Whether the block runs under autocast over fp32 weights: an fp32 residual stream, half products."""
    return s.autocast


def stream(s: BlockShape) -> float:
    """Bytes of one ``(b, L, d)`` tensor of the residual stream on this rank (fp32 under autocast)."""
    return s.tokens * s.d * (4 if amp(s) else s.e) / s.split


def weight_elems(s: BlockShape) -> tuple[float, int]:
    """Elements of one rank's block weights and biases (norms left out: autocast runs them in fp32), and
    their tensors (the kernels a cast of them takes)."""
    d, f, t = s.d, s.f, s.t
    return (3 * d * d + d * d + 2 * d * f) / t + (3 * d + f) / t + 2 * d, 8


def memory_forward(s: BlockShape) -> list[Op]:
    """Two norms, the GELU, two residual adds (and two dropouts): read and write their tensors once; under
    autocast each norm's output cast to the half type, the adds reading the half branch and the fp32 stream,
    and the weights cast."""
    T, d, e, f, t = s.tokens, s.d, s.e, s.f, s.t
    act, res = T * d * e / s.split, stream(s)
    add = res * 2 + act if amp(s) else 3 * act
    mixed = "cast" if amp(s) else "elem"  # a half operand into fp32: PyTorch's casting element-wise kernel
    ops = [
        Op("ln1", "norm", bytes=2 * res),
        Op("ln2", "norm", bytes=2 * res),
        Op("gelu", "gelu", bytes=2 * T * f * e / t),
    ]
    ops += [Op("residual1", mixed, bytes=add), Op("residual2", mixed, bytes=add)]
    if s.dropout:
        mask = T * d / s.split
        ops += [Op("dropout1", "elem", bytes=2 * act + mask), Op("dropout2", "elem", bytes=2 * act + mask)]
    if amp(s):
        n, tensors = weight_elems(s)
        ops += [Op("ln1.cast", "elem", bytes=res + act), Op("ln2.cast", "elem", bytes=res + act)]
        ops.append(Op("weights.cast", "elem", bytes=n * (4 + e), kernels=tensors))
    return ops


def memory_backward(s: BlockShape) -> list[Op]:
    """A norm's backward reads its input and output gradient and writes the input gradient (and reduces the
    weight's); the GELU's reads input and gradient; the residual stream adds the branch's gradient. foldtrain's
    own block also reduces the biases' gradients over the tokens and packs q, k and v's gradients into the
    qkv product's (a stack, then a copy for the view); under autocast it casts the norm outputs' and the
    branches' gradients between the half type and fp32, and the weights' gradients to fp32."""
    T, d, e, f, t = s.tokens, s.d, s.e, s.f, s.t
    act, res = T * d * e / s.split, stream(s)
    add = res * 3 + act if amp(s) else 3 * act  # under autocast: the branch's gradient cast, then added in fp32
    ops = [
        Op("ln1.bwd", "norm", bytes=3 * res, kernels=2),
        Op("ln2.bwd", "norm", bytes=3 * res, kernels=2),
        Op("gelu.bwd", "gelu", bytes=3 * T * f * e / t),
        Op("residual1.bwd", "elem", bytes=add, kernels=2 if amp(s) else 1),
        Op("residual2.bwd", "elem", bytes=add, kernels=2 if amp(s) else 1),
    ]
    if s.dropout:
        mask = T * d / s.split
        ops += [Op("dropout1.bwd", "elem", bytes=act + mask + act), Op("dropout2.bwd", "elem", bytes=2 * act + mask)]
    if s.native:
        ops.append(Op("bias.grad", "reduce", bytes=T * (3 * d / t + d + f / t + d) * e, kernels=4, weight_grad=True))
        ops.append(Op("qkv.grad_pack", "pack", bytes=4 * T * 3 * d * e / t, kernels=2))
    if amp(s):  # half gradients into fp32 ones: the casting kernel again
        n, tensors = weight_elems(s)
        ops += [Op("ln1.cast.bwd", "cast", bytes=res + act), Op("ln2.cast.bwd", "cast", bytes=res + act)]
        ops.append(Op("weights.cast.bwd", "cast", bytes=n * (4 + e), kernels=tensors, weight_grad=True))
    return ops


def block_forward(s: BlockShape) -> list[Op]:
    """A block's forward (the order of the list is not the kernels' order: costs add up)."""
    return linear_forward(s) + attention_forward(s) + memory_forward(s)


def block_backward(s: BlockShape) -> list[Op]:
    return linear_backward(s) + attention_backward(s) + memory_backward(s)


def head_ops(s: BlockShape, vocab: int) -> list[Op]:
    """The fused head, forward and backward in one pass: the final norm, the output projection (``V / t``
    columns) and its two backward products, and the fp32 loss (log-softmax and its gradient over the logits,
    read and written in each of the head's three passes: 24 bytes a logit); under autocast the norm's output
    and the (tied) weight cast to the half type and back."""
    T, d, e = s.tokens, s.d, s.e
    cols = vocab // s.t
    act, res = T * d * e / s.split, stream(s)
    ops = [
        Op("ln_f", "norm", bytes=2 * res),
        gemm("lm_head", T, cols, d, layout="nt"),
        Op("cross_entropy", "softmax", bytes=24.0 * T * cols, kernels=4),
        gemm("lm_head.dgrad", T, d, cols, layout="nn"),
        gemm("lm_head.wgrad", d, cols, T, layout="tn"),
        Op("ln_f.bwd", "norm", bytes=3 * res, kernels=2),
    ]
    if amp(s):
        casts = 2 * (res + act) + 2 * cols * d * (4 + e)
        ops.append(Op("head.casts", "elem", bytes=casts, kernels=4))
    return ops


def gemm_shapes(s: BlockShape, vocab: int) -> list[tuple[int, int, int, str]]:
    """Every distinct ``(M, N, K, layout)`` a step of this shape multiplies (blocks, attention's products when
    unfused, the head), forward and backward: what ``calibrate --device cuda`` measures."""
    ops = block_forward(s) + block_backward(s) + head_ops(s, vocab)
    return sorted({op.key for op in ops if op.kind == "gemm"})


def attention_shape(s: BlockShape) -> tuple[int, int, int, int]:
    return (s.b, s.local_heads, s.L, s.head_dim)
