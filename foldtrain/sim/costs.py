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

from .cluster import Cluster
from .setup import Setup


def block_params(s: Setup) -> float:
    d = s.d_model
    return (12 * d * d) / s.tp + 13 * d


def embed_params(s: Setup) -> float:
    return s.vocab * s.d_model / s.tp + s.context * s.d_model


def segment_params(s: Setup, seg: int) -> float:
    """Parameters of global segment ``seg`` held by one tensor-parallel rank (tied copies counted where held)."""
    n = s.layers[seg] * block_params(s)
    last = s.segments - 1
    if seg == 0:
        n += embed_params(s)
    if seg == last:
        n += 2 * s.d_model
        if last > 0:
            n += s.vocab * s.d_model / s.tp  # the head's copy of the tied embedding
    return n


def model_params(s: Setup) -> float:
    """Parameters of the whole model (tied embedding once, tp = 1)."""
    d = s.d_model
    return s.n_layer * (12 * d * d + 13 * d) + s.vocab * d + s.context * d + 2 * d


def rank_segments(s: Setup, p: int) -> list[int]:
    return [c * s.pp + p for c in range(s.virtual)]


class CostModel:
    """Durations (s) and bytes of every simulated action for a :class:`Setup` on a :class:`Cluster`."""

    def __init__(self, s: Setup, c: Cluster):
        self.s, self.c = s, c
        self.peak = c.peak(s.dtype)
        b, L, d, t = s.micro_batch, s.seq, s.d_model, s.tp
        tokens = b * L
        self.tokens = tokens
        eff = c.matmul_efficiency
        width = d / t if t > 1 else d
        head_dim = d / s.n_head
        lin = 24 * d * d / t * tokens / (self.peak * eff(min(tokens, width), rows=tokens < width))
        attn = 4 * L * d / t * tokens / (self.peak * eff(min(L, head_dim)))
        # element-wise traffic: Korthikanti et al.'s activation bytes per block, written and read once
        elem = 2 * self.act_bytes_block(recompute=False) / (c.elem_bw or c.mem_bw)
        self.t_block_f = lin + attn + elem + c.layer_overhead
        n_head = min(tokens, d, s.vocab / t)
        self.t_head_f = 2 * d * s.vocab / t * tokens / (self.peak * eff(n_head, rows=tokens == n_head and tokens < d))
        # the loss's log-softmax over fp32 logits, forward and backward: memory-bound on a GPU (read and
        # write the logits in each of the head's three passes); a CPU is bound by exp() instead (calibrated)
        logits = tokens * s.vocab / t
        self.t_softmax = logits / c.softmax_rate if c.softmax_rate > 0 else 3 * 2 * logits * 4 / c.mem_bw
        if c.head_weight_rate > 0:  # calibrated on a CPU: streaming the head's weight and accumulating its gradient
            self.t_softmax += d * s.vocab / t / c.head_weight_rate
        self.t_embed_f = tokens * d * (s.act_bytes + 4) / c.mem_bw
        # tensor-parallel all-reduces of the (b, L, d) activation, on the node's link (tp never spans nodes)
        self.t_tp_ar = self.ring_allreduce_time(tokens * d * s.act_bytes, t, c.intra.bw, c.intra.coll) if t > 1 else 0.0

    # ---------------------------------------------------------------- memory sizes
    def act_bytes_block(self, recompute: bool) -> float:
        """Activation bytes one block keeps for its backward, per micro-batch (Korthikanti et al. 2022, no
        sequence parallelism), scaled from their 2-byte numbers to this precision; with recomputation only
        the block's input."""
        s = self.s
        b, L, d, a, t = s.micro_batch, s.seq, s.d_model, s.n_head, s.tp
        if recompute:
            return L * b * d * s.act_bytes
        half = L * b * d * (10 + 24 / t + 5 * a * L / (d * t))
        return half * s.act_bytes / 2

    # ---------------------------------------------------------------- compute
    def forward(self, seg: int) -> float:
        s = self.s
        n = s.layers[seg]
        t = n * (self.t_block_f + 2 * self.t_tp_ar)
        if seg == 0:
            t += self.t_embed_f + (self.t_tp_ar if s.tp > 1 else 0.0)
        if seg == s.segments - 1:
            t += 3 * self.t_head_f + self.t_softmax  # fused head: forward and backward of head and loss
        return t

    def backward(self, seg: int) -> float:
        s = self.s
        n = s.layers[seg]
        per = self.c.backward_ratio * self.t_block_f + 2 * self.t_tp_ar
        if s.ac:
            per += self.t_block_f + 2 * self.t_tp_ar
        t = n * per
        if seg == 0:
            t += 2 * self.t_embed_f
        return t

    def optim(self, seg: int, shard: float = 1.0) -> float:
        s = self.s
        per = 28 + (6 if s.master else 0)
        n = segment_params(s, seg) * shard
        if self.c.optim_rate > 0:  # calibrated (a CPU: AdamW's arithmetic binds it, not its bytes)
            return n * per / 28 / self.c.optim_rate + self.c.layer_overhead
        return n * per / self.c.mem_bw + self.c.layer_overhead

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
