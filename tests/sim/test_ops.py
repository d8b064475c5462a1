"""The per-operation cost model: what each operation computes or moves, and how a cluster prices it."""

from __future__ import annotations

import dataclasses

import pytest

from foldtrain.config import build_config
from foldtrain.sim import ops
from foldtrain.sim.cluster import Measured, from_dict
from foldtrain.sim.costs import CostModel
from foldtrain.sim.setup import resolve_setup

from .conftest import cluster_dict

approx = pytest.approx


def _setup(*args):
    cfg = build_config(["--model.preset", "gpt2-small", "--train.seq_len", "128", "--precision", "bf16", *args])
    return resolve_setup(cfg)


def test_a_blocks_products_and_attention_count_megatrons_flops():
    """Forward: 24 d^2 per token and rank over t for the four products; causal fused attention half of
    4 L d / t per token; the backward's products twice the forward's, its attention 2.5 times."""
    s = ops.BlockShape(b=4, L=256, d=512, heads=8, t=2)
    fwd = ops.block_forward(s)
    lin = sum(op.flops for op in fwd if op.kind == "gemm")
    att = sum(op.flops for op in fwd if op.kind == "attention")
    assert lin == approx(24 * 512**2 * s.tokens / 2)
    assert att == approx(4 * 256 * 512 * s.tokens / 2 / 2)
    bwd = ops.block_backward(s)
    assert sum(op.flops for op in bwd if op.kind == "gemm") == approx(2 * lin)
    assert sum(op.flops for op in bwd if op.kind == "attention") == approx(2.5 * att)
    unfused = dataclasses.replace(s, attention="unfused")
    assert sum(op.flops for op in ops.block_forward(unfused) if op.kind == "gemm") == approx(
        lin + 2 * att
    )  # all of the scores
    assert (s.tokens, 3 * 512 // 2, 512, "nt") in ops.gemm_shapes(s, 1000)  # qkv: x W^T
    assert (512, 1000 // 2, s.tokens, "tn") in ops.gemm_shapes(s, 1000)  # the head's weight gradient: x^T dy
    assert ops.attention_shape(s) == (4, 4, 256, 64)


def test_sequence_parallelism_and_dropout_change_the_memory_bound_bytes():
    s = ops.BlockShape(b=2, L=128, d=256, heads=4, t=4)
    base = sum(op.bytes for op in ops.memory_forward(s))
    sp = sum(op.bytes for op in ops.memory_forward(dataclasses.replace(s, seq_parallel=True)))
    drop = sum(op.bytes for op in ops.memory_forward(dataclasses.replace(s, dropout=True)))
    gelu = 2 * s.tokens * 4 * 256 * 2 / 4
    assert sp - gelu == approx((base - gelu) / 4)  # norms and residuals split over the 4 ranks; GELU already is
    assert drop > base


def test_a_measured_shape_runs_at_its_rate_others_on_the_curve():
    s = _setup("--train.global_batch", "1")
    c = from_dict(cluster_dict(), "c.toml")
    cm = CostModel(s, c)
    qkv = ops.linear_forward(cm.shape)[0]
    assert cm.gemm_rate(qkv) == approx(100e12)  # the test cluster's curve: efficiency 1, no half size
    measured = dataclasses.replace(c, gemm=Measured({"bf16": {qkv.key: 25e12}}))
    cm2 = CostModel(s, measured)
    assert cm2.op_time(qkv) == approx(qkv.flops / 25e12)
    assert cm2.t_block_f > cm.t_block_f
    # the same shape in another layout is another product: measured "nn", the forward's "nt" is on the curve
    other = dataclasses.replace(c, gemm=Measured({"bf16": {(*qkv.shape, "nn"): 25e12}}))
    assert CostModel(s, other).gemm_rate(qkv) == approx(100e12)


def test_a_cluster_files_gemm_layouts_round_trip_and_default_to_nn():
    from foldtrain.config.load import tomllib
    from foldtrain.errors import ConfigError
    from foldtrain.sim.cluster import to_toml

    def cluster(table):
        return from_dict({**cluster_dict(), "gemm": {"bf16": table}}, "c.toml")

    table = {"shapes": [[64, 32, 16], [64, 32, 16]], "layouts": ["nt", "tn"], "tflops": [5.0, 1.0]}
    c = cluster(table)
    assert c.gemm.get("bf16", (64, 32, 16, "nt")) == approx(5e12)
    assert c.gemm.get("bf16", (64, 32, 16, "tn")) == approx(1e12)
    assert from_dict(tomllib.loads(to_toml(c)), "again.toml").gemm.rates == c.gemm.rates
    old = cluster({"shapes": [[64, 32, 16]], "tflops": [5.0]})  # written before layouts: plain a @ b
    assert old.gemm.get("bf16", (64, 32, 16, "nn")) == approx(5e12)
    with pytest.raises(ConfigError, match="layouts"):
        cluster({**table, "layouts": ["nt", "xx"]})


def test_fused_attention_has_its_own_kernel_model_else_two_products_and_a_softmax():
    s = _setup("--train.global_batch", "2")
    c = from_dict(cluster_dict(), "c.toml")
    assert CostModel(s, c).shape_for_attention().attention == "unfused"
    fused = from_dict(cluster_dict(device__attention_efficiency=0.5, device__attention_half_seq=128), "c.toml")
    cm = CostModel(s, fused)
    att = ops.attention_forward(cm.shape_for_attention())
    assert [op.kind for op in att] == ["attention"]
    assert cm.op_time(att[0]) == approx(att[0].flops / (100e12 * 0.5 * 128 / 256))


def test_a_pass_takes_at_least_its_kernels_launches():
    """Eager mode: the host launches every kernel; with launches far longer than the kernels the pass is
    host-bound and takes kernels x launch_us."""
    s = _setup("--train.global_batch", "1")
    slow = from_dict(cluster_dict(device__launch_us=1000, device__attention_efficiency=0.5), "c.toml")
    cm = CostModel(s, slow)
    kernels = sum(op.kernels for op in ops.block_forward(cm.shape))
    assert cm.t_block_f == approx(kernels * 1e-3, rel=1e-6)
    fast = from_dict(cluster_dict(device__launch_us=0.001, device__attention_efficiency=0.5), "c.toml")
    assert CostModel(s, fast).t_block_f < kernels * 1e-3 / 10


def test_memory_bound_kernels_run_at_their_own_bandwidth():
    s = _setup("--train.global_batch", "1")
    cm = CostModel(s, from_dict(cluster_dict(device__norm_gbs=10), "c.toml"))
    norm = next(op for op in ops.memory_forward(cm.shape) if op.kind == "norm")
    gelu = next(op for op in ops.memory_forward(cm.shape) if op.kind == "gelu")
    assert cm.op_time(norm) == approx(norm.bytes / 10e9)
    assert cm.op_time(gelu) == approx(gelu.bytes / 1000e9)  # no gelu_gbs, no elem_gbs: mem_bw_gbs


def test_selective_recomputation_pays_the_attention_core_again_and_drops_its_activations():
    s = _setup("--train.global_batch", "1", "--parallel.pp", "2")
    c = from_dict(cluster_dict(), "c.toml")
    s = dataclasses.replace(s, attention="unfused")  # a fused kernel keeps no scores to drop
    base, sel = CostModel(s, c), CostModel(dataclasses.replace(s, selective=True), c)
    assert sel.backward(0) > base.backward(0)
    assert sel.act_bytes_block(False) < base.act_bytes_block(False)


def test_foldtrains_own_block_adds_its_casts_bias_sums_and_qkv_pack():
    """What the H200 kernel profile showed foldtrain's block runs beyond the textbook list (docs/gpu.md): bias
    gradients summed over the tokens and q/k/v's gradients packed into qkv's, and under autocast an fp32
    residual stream (norms on fp32, their outputs cast to half and back, the adds mixing the two)."""
    plain = ops.BlockShape(b=2, L=64, d=128, heads=4, e=2)
    amp = dataclasses.replace(plain, native=True, autocast=True)
    names = {op.name for op in ops.block_forward(plain) + ops.block_backward(plain)}
    assert not names & {"bias.grad", "qkv.grad_pack", "ln1.cast", "weights.cast.bwd"}
    by = {op.name: op for op in ops.block_forward(amp) + ops.block_backward(amp)}
    T, d = plain.tokens, plain.d
    assert by["bias.grad"].kind == "reduce" and by["bias.grad"].bytes == T * (3 * d + d + 4 * d + d) * 2
    assert by["qkv.grad_pack"].kind == "pack" and by["qkv.grad_pack"].bytes == 4 * T * 3 * d * 2  # stack + copy
    assert by["ln1"].bytes == 2 * T * d * 4  # the fp32 stream in and out
    assert by["ln1.cast"].bytes == T * d * (4 + 2) and by["ln1.cast.bwd"].kind == "cast"
    assert by["residual1"].kind == "cast" and by["residual1"].bytes == T * d * (4 + 4 + 2)
    # fp32 training: the same native block without casts
    fp32 = dataclasses.replace(plain, native=True, e=4)
    assert not {op.name for op in ops.block_backward(fp32)} & {"ln1.cast.bwd", "weights.cast.bwd"}
    assert "bias.grad" in {op.name for op in ops.block_backward(fp32)}


def test_the_simulator_prices_foldtrains_block_natively_and_other_systems_not():
    s = _setup("--train.global_batch", "1", "--precision", "bf16")
    c = from_dict(cluster_dict(device__pack_gbs=1, device__cast_gbs=1, device__reduce_gbs=1), "c.toml")
    native = CostModel(s, c)
    assert native.shape.native and native.shape.autocast
    pack = next(op for op in ops.block_backward(native.shape) if op.kind == "pack")
    assert native.op_time(pack) == approx(pack.bytes / 1e9)  # priced at its own bandwidth
    other = CostModel(dataclasses.replace(s, native=False), c)
    assert other.t_block_b < native.t_block_b
    names = {op.name for op in ops.block_backward(other.shape)}
    # autocast's fp32 stream and weight casts are autocast's, whoever's block; the bias sums and qkv pack not
    assert ops.amp(other.shape) and "weights.cast.bwd" in names and not names & {"bias.grad", "qkv.grad_pack"}
    # half-precision weights with fp32 masters: no autocast casts
    assert not ops.amp(CostModel(dataclasses.replace(s, native=False, master=True), c).shape)
