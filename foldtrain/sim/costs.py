"""Costs of the simulated actions: compute from FLOPs, transfers from bytes, links from the placement.

Per transformer block and token (``d`` = d_model, ``L`` = sequence, ``t`` = tensor-parallel size),
forward: ``(24 d^2 + 4 L d) / t`` FLOPs (qkv, projection, MLP; scores and values); the LM head
``2 d V / t``; a block's backward takes ``backward_ratio`` times its forward (2, the FLOP ratio, on the
GPU presets; ``foldtrain calibrate`` measures it), plus one more forward of every block with ``--ac full``
(recomputation). The last segment's forward runs the fused head (head forward + backward) and its
backward skips it. A matrix product of smallest dimension ``n`` runs at
``peak(dtype) * efficiency * n / (n + half_size)`` (``rows_half_size`` when ``n`` is its rows, the
micro-batch's tokens: a CPU runs few-row products much worse than few-column ones); element-wise
work (layer norms, GELU, softmax, residuals) moves about the activation bytes of Korthikanti et al.
(2022) through device memory (at ``elem_bw``, which ``foldtrain calibrate`` fits to a real block's forward: on a CPU
transcendental functions, not bytes, bound it); the loss's log-softmax runs at ``softmax_rate``
elements/s when calibrated, else it is memory-bound (calibrated on a CPU from the real fused head, together
with ``head_weight_rate``: its cost per weight element beyond its FLOPs);
each block and pass pays ``layer_overhead``. Tensor parallelism adds Megatron's two all-reduces
of the ``(b, L, d)`` activation per block in the forward and two in the backward (two more with
recomputation) on the node's link, inside F and B.

Optimizer step: AdamW reads parameter, gradient and two moments and writes three of them
(28 bytes per fp32 parameter, +6 with a half model copy and fp32 masters) at memory bandwidth, or at
the calibrated ``optim_rate`` parameters/s (a CPU).

Communication: a transfer of ``n`` bytes costs ``latency + n / bandwidth`` on its link, where
the bandwidth of a shared link is divided among the transfers in flight on it (see
:mod:`.events`). Placement follows the mesh: global rank ``(d * P + p) * T + t``, ``G`` ranks per
node; only the ranks of one pipeline (``d = 0``, ``t = 0``) are simulated and each transfer is
weighted by the number of identical ranks of its node doing the same at the same time.
"""

from __future__ import annotations

import math
from dataclasses import replace

from foldtrain.schedules import Op, chunks_of_rank, placement_of, runs_backward, stage_rank

from . import ops
from .cluster import KIND_BANDWIDTH, Cluster
from .setup import Setup


def block_params(s: Setup) -> float:
    d = s.d_model
    return (12 * d * d) / s.tp + 13 * d


def tied_params(s: Setup) -> float:
    """The tied embedding / head weight's parameters on one tensor-parallel rank (vocabulary-parallel)."""
    return s.vocab * s.d_model / s.tp


def embed_params(s: Setup) -> float:
    return tied_params(s) + s.context * s.d_model


def segment_params(s: Setup, seg: int) -> float:
    """Parameters of global segment ``seg`` held by one tensor-parallel rank (tied copies counted where held)."""
    n = s.layers[seg] * block_params(s)
    last = s.segments - 1
    if seg == 0:
        n += embed_params(s)
    if seg == last:
        n += 2 * s.d_model
        if last > 0:
            n += tied_params(s)  # the head's copy of the tied embedding
    return n


def whole_params(s: Setup, seg: int) -> float:
    """Parameters of segment ``seg`` that the distributed optimizer does not slice over dp: the tied weight's copy
    where the pipeline splits the tie (every dp rank has its gradient in full and steps all of it, or with
    ``tied_halves`` half of it, :func:`whole_share`), unless ``--optim.shard_tied`` slices it too (and all-gathers it
    with the rest)."""
    if s.pp > 1 and seg in (0, s.segments - 1) and not s.shard_tied:
        return tied_params(s)
    return 0.0


def whole_share(s: Setup) -> float:
    """The fraction of :func:`whole_params` a rank steps: half where the two ends split the copy's state."""
    return 0.5 if s.tied_halves else 1.0


def split_gathered_bytes(s: Setup, seg: int) -> float:
    """Bytes the all-gather of the tied copy's halves brings segment ``seg``'s end from the other end after a step
    (``tied_halves``), on the pair's link; 0 where none."""
    return tied_params(s) / 2 * s.weight_bytes if s.tied_halves and whole_params(s, seg) else 0.0


def sliced_tied_copy(s: Setup, seg: int) -> bool:
    """Whether segment ``seg`` holds a copy of the tied weight that the distributed optimizer slices over dp
    (``--optim.shard_tied``, where the pipeline splits the tie)."""
    return s.dist_optim and s.shard_tied and s.pp > 1 and seg in (0, s.segments - 1)


def lookup_rows(s: Setup, seg: int) -> float:
    """Rows of the tied weight the embedding's copy takes after a step, where ``--optim.shard_tied`` slices it and
    nothing else in the segment reads it (the first segment, without tensor parallelism): those the step's token
    ids name over every dp rank, at most the vocabulary (``ChunkShards.land``); 0 where it is all-gathered whole."""
    if not (sliced_tied_copy(s, seg) and s.tp == 1 and seg == 0):
        return 0.0
    return min(float(s.vocab), s.dp * s.microbatches * s.micro_batch * s.seq)


def gathered_bytes(s: Setup, seg: int, without_tied: bool = False) -> float:
    """Bytes the distributed optimizer's all-gather of segment ``seg`` moves after its step: its sliced weights, in
    their dtype; a lookup-only tied copy's rows instead of its whole (an all-reduce of fp32 rows: twice their
    bytes, as a gather's). ``without_tied``: the tied copy's slice stepped apart (:func:`tied_gathered_bytes`)."""
    n = segment_params(s, seg) - whole_params(s, seg)
    rows = lookup_rows(s, seg)
    if rows:
        n -= tied_params(s)
    return n * s.weight_bytes + 2 * rows * s.d_model * 4 - (tied_gathered_bytes(s, seg) if without_tied else 0.0)


def tied_gathered_bytes(s: Setup, seg: int) -> float:
    """Bytes of the all-gather of segment ``seg``'s sliced tied copy alone (``--optim.shard_tied``, where the segment
    reads all of its rows), 0 where none: what steps apart at an iteration's end (the rules' ``early_tie``)."""
    return tied_params(s) * s.weight_bytes if sliced_tied_copy(s, seg) and not lookup_rows(s, seg) else 0.0


def stepped_share(s: Setup, seg: int) -> float:
    """The fraction of segment ``seg``'s parameters whose AdamW state a rank holds and steps."""
    share = s.optim_share
    if s.dist_optim and share < 1.0:
        n, whole = segment_params(s, seg), whole_params(s, seg)
        return ((n - whole) * share + whole * whole_share(s)) / n
    return share


def model_params(s: Setup) -> float:
    """Parameters of the whole model (tied embedding once, tp = 1)."""
    d = s.d_model
    return s.n_layer * (12 * d * d + 13 * d) + s.vocab * d + s.context * d + 2 * d


def block_shape(s: Setup) -> ops.BlockShape:
    """One tensor-parallel rank's micro-batch as :mod:`.ops` describes it."""
    return ops.BlockShape(
        b=s.micro_batch,
        L=s.seq,
        d=s.d_model,
        heads=s.n_head,
        t=s.tp,
        e=s.act_bytes,
        attention=s.attention,
        dropout=s.dropout,
        seq_parallel=s.seq_parallel,
        native=s.native,
        autocast=s.dtype != "fp32" and not s.master,
    )


# output tiles cuBLAS chooses among for half-precision products (NVIDIA, "Matrix Multiplication Background
# User's Guide": larger tiles reuse more data, smaller ones fill more SMs)
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))


def wave_efficiency(m: int, n: int, batch: int, sms: float) -> float:
    """Share of the SMs a product's tiles keep busy over its waves, for the best tile: ``tiles / (waves x
    sms)`` (a last, partial wave leaves SMs idle: wave quantization)."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, tiles / (math.ceil(tiles / sms) * sms))
    return best


def rank_segments(s: Setup, p: int) -> list[int]:
    """The segments pipeline rank ``p`` holds, in the schedule's placement."""
    return chunks_of_rank(p, s.pp, s.virtual, placement_of(s.schedule))


def segment_rank(s: Setup, seg: int) -> int:
    """The pipeline rank holding segment ``seg``, in the schedule's placement."""
    return stage_rank(seg, s.pp, placement_of(s.schedule))


class CostModel:
    """Durations (s) and bytes of every simulated action for a :class:`Setup` on a :class:`Cluster`."""

    def __init__(self, s: Setup, c: Cluster):
        self.s, self.c = s, c
        self.peak = c.peak(s.dtype)
        self.shape = block_shape(s)
        self.tokens = self.shape.tokens
        self.priced = self.shape_for_attention()  # the block as its operations are priced
        self.block_f_parts = self.pass_parts(ops.block_forward(self.priced))
        self.t_block_f = self._pass(*self.block_f_parts)
        backward = ops.block_backward(self.priced)
        self.t_block_b = c.backward_ratio * self.t_block_f if c.backward_ratio > 0 else self.pass_time(backward)
        # a split backward (zero-bubble schedules): W's share of it, measured or priced from the weight-gradient
        # operations, and what splitting costs beyond the whole backward (measured, else nothing)
        self.w_share = c.split_weight_share or self.weight_share(backward)
        self.split_ratio = c.split_ratio or 1.0
        # Korthikanti et al.'s selective recomputation: the attention core again in the backward
        self.t_attn_recompute = self.pass_time(ops.attention_forward(self.priced), overhead=False)
        self.t_head = self.head_time()
        self.t_embed_f = self.tokens * s.d_model * (s.act_bytes + 4) / c.mem_bw
        # tensor-parallel all-reduces of the (b, L, d) activation, on the node's link (tp never spans nodes)
        t = s.tp
        nbytes = self.tokens * s.d_model * s.act_bytes
        self.t_tp_ar = self.ring_allreduce_time(nbytes, t, c.intra.bw, c.intra.coll) if t > 1 else 0.0

    # ---------------------------------------------------------------- the operations' prices
    def shape_for_attention(self) -> ops.BlockShape:
        """Fused attention needs a model of its kernel (calibrated, or the preset's efficiency); without one
        it is priced as what it computes: two batched products around a softmax."""
        c, sh = self.c, self.shape
        fused = c.attn_eff > 0 or c.attn_fwd.get(self.s.dtype, ops.attention_shape(sh)) > 0
        return sh if sh.attention != "flash" or fused else replace(sh, attention="unfused")

    def gemm_rate(self, op: ops.Op) -> float:
        """FLOP/s of a product: measured at its shape, else the efficiency curve of its smallest dimension
        (``rows``: that dimension is its rows, the micro-batch's tokens)."""
        measured = self.c.gemm.get(self.s.dtype, op.key)
        if measured > 0:
            return measured
        m, n, k = op.shape
        c = self.c
        if c.sms > 0:
            return self.peak * c.efficiency * wave_efficiency(m, n, op.batch, c.sms) * k / (k + c.gemm_k_half)
        smallest = min(m, n, k)
        return self.peak * c.matmul_efficiency(smallest, rows=m == smallest and m < min(n, k))

    def attention_rate(self, op: ops.Op) -> float:
        """FLOP/s of the fused attention kernel: measured at its shape, else the cluster's efficiency by
        sequence and head dimension; times ``Setup.attention_speed`` (an older kernel than the cluster's)."""
        table = self.c.attn_bwd if op.name.endswith(".bwd") else self.c.attn_fwd
        measured = table.get(self.s.dtype, op.shape)
        if measured > 0:
            return measured * self.s.attention_speed
        eff = self.c.attn_bwd_eff if op.name.endswith(".bwd") else self.c.attn_eff
        L, hd = op.shape[2], op.shape[3]
        seq, head = self.c.attn_half_seq, self.c.attn_half_hd
        curve = (L / (L + seq) if seq > 0 else 1.0) * hd / (hd + head)
        return self.peak * (eff or self.c.attn_eff) * curve * self.s.attention_speed

    def bandwidth(self, kind: str) -> float:
        c = self.c
        own = getattr(c, KIND_BANDWIDTH[kind]) if kind in KIND_BANDWIDTH else 0.0
        return own or c.elem_bw or c.mem_bw

    def op_time(self, op: ops.Op) -> float:
        fixed = op.kernels * self.c.kernel_time
        if op.kind == "gemm":
            return op.flops / self.gemm_rate(op) + fixed
        if op.kind == "attention":
            return op.flops / self.attention_rate(op) + fixed
        return op.bytes / self.bandwidth(op.kind) + fixed

    def pass_parts(self, todo: list[ops.Op]) -> tuple[float, float]:
        """``(device, host)`` seconds of a pass over ``todo``: the device's time for its kernels; the host's
        time to launch them plus its fixed cost per block and pass."""
        device = sum(self.op_time(op) for op in todo)
        return device, sum(op.kernels for op in todo) * self.c.launch + self.c.layer_overhead

    def pass_time(self, todo: list[ops.Op], overhead: bool = True) -> float:
        """A pass: on a GPU the longer of the device's and the host's parts (eager mode: the host runs ahead
        of the device while kernels are longer than a launch); without launches (a CPU) the host is the
        device, and its fixed cost adds to the work. ``overhead=False``: kernels only, no fixed cost."""
        device, host = self.pass_parts(todo)
        return self._pass(device, host - (0.0 if overhead else self.c.layer_overhead))

    def _pass(self, device: float, host: float) -> float:
        return device + host if self.c.launch <= 0 else max(device, host)

    def forward_parts(self, seg: int) -> tuple[float, float]:
        """``(device, host)`` of segment ``seg``'s forward (``forward(seg)`` when the host's part is free):
        the blocks' kernels, tensor-parallel all-reduces, the embedding and the head as device time, the
        blocks' launches and fixed costs as the host's."""
        s = self.s
        dev, host = self.block_f_parts
        d, h = s.layers[seg] * (dev + 2 * self.t_tp_ar), s.layers[seg] * host
        if seg == 0:
            d += self.t_embed_f
        if seg == s.segments - 1:
            d += self.t_head  # a few long kernels: device time
        return d, h

    def head_time(self) -> float:
        """The fused head, forward and backward in the last segment's forward; on a CPU calibration the loss
        runs at its measured rate (``softmax_gelems``) instead of by bytes, and streaming the head's weight
        and accumulating its gradient costs ``head_weight_gelems`` beyond the products."""
        c, s = self.c, self.s
        todo = ops.head_ops(self.shape, s.vocab)
        self.t_head_gemms = sum(self.op_time(op) for op in todo if op.kind == "gemm")
        cols = s.vocab / s.tp
        weight = s.d_model * cols / c.head_weight_rate if c.head_weight_rate > 0 else 0.0
        if c.softmax_rate <= 0:
            return self.pass_time(todo, overhead=False) + weight
        norms = sum(self.op_time(op) for op in todo if op.kind == "norm")
        return self.t_head_gemms + self.tokens * cols / c.softmax_rate + weight + norms

    def weight_share(self, backward: list[ops.Op]) -> float:
        """The share of a block's backward (its operations) that computes the weights' gradients."""
        whole = self.pass_time(backward, overhead=False)
        return self.pass_time([op for op in backward if op.weight_grad], overhead=False) / whole if whole else 0.5

    def memory_bytes(self, todo: list[ops.Op]) -> float:
        """Bytes the memory-bound kernels of ``todo`` move (what ``calibrate`` fits ``elem_gbs`` against)."""
        return sum(op.bytes for op in todo if op.kind not in ("gemm", "attention"))

    # ---------------------------------------------------------------- memory sizes
    def act_bytes_block(self, recompute: bool) -> float:
        """Activation bytes one block keeps for its backward, per micro-batch: Korthikanti et al. (2022),
        ``L b d (10 + 24/t + 5 a L / (d t))`` at 2 bytes per element, scaled to this precision (with sequence
        parallelism ``34/t`` for the first two terms; with full recomputation only the block's input). Their
        count holds two 1-byte dropout masks per element and, in the attention core, the scores' softmax (2),
        its dropout mask (1) and output (2): without dropout the masks and the core's dropout go; a fused
        attention kernel (foldtrain's SDPA) keeps no scores at all (its output is the projection's input,
        counted); selective recomputation drops the core too. foldtrain's autocast keeps the two norms'
        inputs in fp32 (4 more)."""
        s = self.s
        b, L, d, a, t = s.micro_batch, s.seq, s.d_model, s.n_head, s.tp
        sp = t if s.seq_parallel else 1
        if recompute:
            return L * b * d * s.act_bytes / sp
        core = 0.0 if s.selective or s.attention == "flash" else (5 if s.dropout else 2) * a * L / (d * t)
        # not split by tp; foldtrain's fp32 norms keep fp32 inputs (MPT's low-precision norms keep half ones)
        whole = (10 if s.dropout else 8) + (4 if ops.amp(self.shape) and s.native else 0)
        return L * b * d * (whole / sp + 24 / t + core) * s.act_bytes / 2

    # ---------------------------------------------------------------- compute
    def forward(self, seg: int) -> float:
        s = self.s
        n = s.layers[seg]
        t = n * (self.t_block_f + 2 * self.t_tp_ar)
        if seg == 0:
            t += self.t_embed_f + (self.t_tp_ar if s.tp > 1 else 0.0)
        if seg == s.segments - 1:
            t += self.t_head  # fused head: forward and backward of head and loss
        return t

    def backward(self, seg: int) -> float:
        s = self.s
        n = s.layers[seg]
        per = self.t_block_b + 2 * self.t_tp_ar
        if s.ac:
            per += self.t_block_f + 2 * self.t_tp_ar
        elif s.selective:
            per += self.t_attn_recompute
        t = n * per
        if seg == 0:
            t += 2 * self.t_embed_f
        return t

    def backward_weight(self, seg: int) -> float:
        """A split backward's ``W`` of segment ``seg``: its blocks' weight-gradient products and reductions
        (:attr:`w_share` of the split backward, :attr:`split_ratio` of the whole one); segment 0's whole backward
        (``runs_backward``)."""
        if runs_backward(Op.BACKWARD_WEIGHT, seg):
            return self.backward(seg)
        return self.s.layers[seg] * self.t_block_b * self.split_ratio * self.w_share

    def backward_input(self, seg: int) -> float:
        """A split backward's ``I``: the rest of the backward (the input's gradient, the tensor-parallel
        all-reduces, any recomputation); nothing for segment 0 (:meth:`backward_weight`)."""
        if not runs_backward(Op.BACKWARD_INPUT, seg):
            return 0.0
        blocks = self.s.layers[seg] * self.t_block_b
        return self.backward(seg) + blocks * (self.split_ratio - 1.0) - self.backward_weight(seg)

    def optim(self, seg: int, shard: float = 1.0, masters: bool = True) -> float:
        """AdamW on ``shard`` of segment ``seg``; ``masters=False``: the stepped fp32 weights are the only copy
        (FSDP's shards), no half copy to write."""
        s = self.s
        per = 28 + (6 if s.master and masters else 0)
        n = segment_params(s, seg) * shard
        if self.c.optim_rate > 0:  # calibrated (a CPU: AdamW's arithmetic binds it, not its bytes)
            return n * per / 28 / self.c.optim_rate + self.c.layer_overhead
        return n * per / (self.c.adamw_bw or self.c.mem_bw) + self.c.layer_overhead

    # ---------------------------------------------------------------- bytes
    def activation_bytes(self) -> float:
        s = self.s
        return s.micro_batch * s.seq * s.d_model * s.act_bytes

    def grad_bytes(self, seg: int) -> float:
        return segment_params(self.s, seg) * self.s.grad_bytes

    @staticmethod
    def ring_allreduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
        """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2 (n-1)/n * nbytes / bw + 2 (n-1) * latency``."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    @staticmethod
    def tree_latency(n: int, lat: float) -> float:
        """A small all-reduce (a scalar) over ``n`` ranks: up and down a tree."""
        return 2 * math.ceil(math.log2(n)) * lat if n > 1 else 0.0


class Placement:
    """Which node a simulated rank is on, and which link a transfer uses (see the module docstring)."""

    def __init__(self, s: Setup, c: Cluster):
        self.s, self.c = s, c
        self.G = c.gpus_per_node
        self.PT = s.pp * s.tp

    def node(self, p: int, d: int = 0) -> int:
        return ((d * self.s.pp + p) * self.s.tp) // self.G

    def p2p_link(self, src: int, dst: int) -> tuple[tuple, float, float]:
        """``(link key, weight, latency)`` of a pipeline transfer from stage ``src`` to ``dst``."""
        if self.node(src) == self.node(dst):
            return ("p2p", src, dst), 1.0, self.c.intra.latency
        return ("nic", self.node(src)), float(self.s.tp), self.c.inter.latency

    def dp_spans_nodes(self) -> bool:
        s = self.s
        if s.dp <= 1:
            return False
        return self.PT >= self.G or s.dp > self.G // self.PT

    def dp_link(self, p: int) -> tuple[tuple, float, float, float]:
        """``(link key, weight, bandwidth, per-step latency)`` of stage ``p``'s data-parallel collective."""
        if self.dp_spans_nodes():
            return ("nic", self.node(p)), float(self.s.tp), self.c.inter.bw, self.c.inter.coll
        return ("dp", p), 1.0, self.c.intra.bw, self.c.intra.coll

    def pipeline_spans_nodes(self) -> bool:
        return self.node(0) != self.node(self.s.pp - 1)

    def world_latency(self) -> float:
        """One small all-reduce over every rank (loss, fp16 overflow vote)."""
        lat = self.c.inter.coll if self.s.world > self.G else self.c.intra.coll
        return CostModel.tree_latency(self.s.world, lat)

    def pipeline_latency(self) -> float:
        lat = self.c.inter.coll if self.pipeline_spans_nodes() else self.c.intra.coll
        return CostModel.tree_latency(self.s.pp * self.s.tp, lat)

    def link_bw(self, key: tuple) -> float:
        if key[0] == "nic":
            return self.c.inter.bw
        return self.c.intra.bw
