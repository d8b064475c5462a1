"""The simulator's ``--dp.strategy fsdp`` in the 3D engine (:mod:`foldtrain.sim.pipeline_fsdp`): which passes
all-gather, the LR's blocking reduce-scatters, gloo's reduce-scatter, the sharded memory and the planner."""

from __future__ import annotations

import dataclasses

import pytest

from foldtrain.cli import main
from foldtrain.config import build_config
from foldtrain.errors import ConfigError
from foldtrain.schedules import Op, build_schedule
from foldtrain.sim.cluster import from_dict
from foldtrain.sim.costs import block_params, segment_params
from foldtrain.sim.pipeline_fsdp import fsdp_host, gathering_actions, peak_buffers, units
from foldtrain.sim.plan import _reductions
from foldtrain.sim.setup import resolve_setup
from foldtrain.sim.simulate import simulate
from tests.sim.conftest import cluster_dict

GPT2 = ["--model.preset", "gpt2-small", "--train.seq_len", "64", "--train.global_batch", "16"]


def cfg(*extra: str):
    return build_config([*GPT2, "--parallel.dp", "2", "--parallel.pp", "2", "--dp.strategy", "fsdp", *extra])


def last_iteration(events: list[dict]) -> list[dict]:
    return [e for e in events if e["step"] == events[-1]["step"]]


def test_a_pass_gathers_its_blocks_where_the_last_one_left_them_sharded():
    """A forward reshards its blocks (``reshard_after_forward``), a backward does not before the LR: so a
    backward after a forward gathers, a forward after a backward does not; without resharding only the first."""
    ops = lambda got: sorted((a.value, m) for a, _, m in got)  # noqa: E731
    f, b = Op.FORWARD.value, Op.BACKWARD.value
    one = build_schedule("1f1b", 2, 1, 4)  # rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    assert ops(gathering_actions(one, 0, True)) == sorted([(f, 0), (f, 1), (b, 0), (b, 1), (b, 2)])
    assert ops(gathering_actions(one, 0, False)) == [(f, 0)]
    gpipe = build_schedule("gpipe", 2, 1, 4)  # every forward, then the first backward
    assert ops(gathering_actions(gpipe, 0, True)) == sorted([(f, 0), (f, 1), (f, 2), (f, 3), (b, 3)])
    # a split backward gathers at its I (a W uses the weights its I took); segment 0 at its W, its whole backward
    i, w = Op.BACKWARD_INPUT.value, Op.BACKWARD_WEIGHT.value
    zb = build_schedule("zb-h1", 2, 1, 4)  # rank 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3; rank 1: F0 I0 F1 I1 W0 ...
    assert ops(gathering_actions(zb, 0, True)) == sorted([(f, 0), (f, 1), (w, 0), (w, 1), (w, 2)])
    assert ops(gathering_actions(zb, 1, True)) == sorted([(f, 0), (i, 0), (i, 1), (i, 2), (i, 3)])
    assert ops(gathering_actions(zb, 1, False)) == [(f, 0)]


def test_a_split_backwards_i_waits_for_all_its_blocks_on_a_gpu():
    """The engine gathers an I's blocks itself, all before its compute (no prefetch); a forward's only the first."""
    c = from_dict(cluster_dict())  # 4 per node: dp 2 x pp 2 in one node, intra 10 GB/s, 10 us
    r = simulate(cfg("--parallel.schedule", "zb-h1", "--parallel.microbatches", "4"), c, keep_events=True)
    s = r.setup
    waits = {e["name"]: e["end"] - e["start"] for e in last_iteration(r.events[1]) if e["kind"] == "reduce_wait"}
    block = block_params(s) * 4 / 2 / 10e9 + 10e-6
    assert waits["AG I c1 m1"] == pytest.approx(s.layers[1] * block, rel=1e-6)
    assert not any(k.startswith("AG W") for k in waits)  # rank 1's W use the weights their I gathered


def test_fsdp2s_host_work_is_paid_by_every_pass_through_the_units_and_more_where_it_gathers():
    """``device.fsdp_unit_us`` per unit with parameters (every block, a root that holds some) and
    ``device.fsdp_root_us`` per chunk in a pass that runs through FSDP's hooks (forwards, the backward passes:
    B, an I, segment 0's W; not a W past it), ``device.fsdp_gather_us`` more per unit the pass gathers (the
    blocks where they are sharded, the root at the chunk's first forward); on the rank's timeline, each of its
    computes is that much longer."""
    unit, root, gather = 300e-6, 700e-6, 500e-6
    base = from_dict(cluster_dict(node__shared_cores=4, device__memory_gb=1000))  # a core per rank
    host = dataclasses.replace(base, fsdp_unit=unit, fsdp_root=root, fsdp_gather=gather)
    assert fsdp_host(host, 3, Op.FORWARD, 1, True) == pytest.approx(3 * (unit + gather) + root)
    assert fsdp_host(host, 3, Op.FORWARD, 1, True, True) == pytest.approx(4 * unit + 3 * gather + root)
    assert fsdp_host(host, 3, Op.FORWARD, 1, True, True, True) == pytest.approx(4 * (unit + gather) + root)
    assert fsdp_host(host, 3, Op.BACKWARD_INPUT, 1, False) == pytest.approx(3 * unit + root)
    assert fsdp_host(host, 3, Op.BACKWARD_WEIGHT, 1, False) == 0.0
    assert fsdp_host(host, 3, Op.BACKWARD_WEIGHT, 0, True) == pytest.approx(3 * (unit + gather) + root)
    assert fsdp_host(base, 3, Op.FORWARD, 1, True, True, True) == 0.0
    run = cfg("--parallel.schedule", "1f1b", "--parallel.microbatches", "4")
    r0, r1 = simulate(run, base, keep_events=True), simulate(run, host, keep_events=True)
    s, sched = r0.setup, build_schedule("1f1b", 2, 1, 4)
    passes = [a for a in sched.ranks[0] if a.op in (Op.FORWARD, Op.BACKWARD)]
    gathers = gathering_actions(sched, 0, s.reshard_after_forward)
    assert units(s, 0)[1] > 0  # rank 0's root holds the embeddings: gathered at the chunk's first forward
    extra = (
        (root + unit) * len(passes)
        + gather
        + sum(s.layers[0] * (unit + (gather if (a.op, a.chunk, a.mb) in gathers else 0.0)) for a in passes)
    )

    def computing(r) -> float:
        return sum(e["end"] - e["start"] for e in last_iteration(r.events[0]) if e["kind"] == "compute")

    # a core per rank: each core-second of it is a second of rank 0's computes
    assert computing(r1) - computing(r0) == pytest.approx(extra, rel=0.02)
    assert r1.step_time > r0.step_time


def test_the_lr_waits_for_every_units_reduce_scatter_and_gloo_pays_an_all_reduce():
    c = from_dict(cluster_dict())  # 4 per node: dp 2 x pp 2 in one node, intra 10 GB/s, 10 us
    r = simulate(cfg("--parallel.microbatches", "4"), c, keep_events=True)
    s = r.setup
    assert s.strategy == "fsdp-3d"
    waits = {e["name"]: e["end"] - e["start"] for e in last_iteration(r.events[0]) if e["kind"] == "reduce_wait"}
    root = segment_params(s, 0) - s.layers[0] * block_params(s)
    units = [block_params(s)] * s.layers[0] + [root]
    # each unit: (n-1)/n of its fp32 gradients over the link, n-1 steps, the received half summed at memory bw
    rs = sum(n * 4 / 2 / 10e9 + 10e-6 + n * 4 / 2 * 3 / 1000e9 for n in units)
    assert waits["RS c0"] == pytest.approx(rs, rel=1e-6)
    # the first forward waits for the root's and the first block's all-gathers (the other blocks are prefetched)
    assert waits["AG F c0 m0"] == pytest.approx((root + block_params(s)) * 4 / 2 / 10e9 + 2 * 10e-6, rel=1e-6)
    assert "AG F c0 m2" not in waits and "AG B c0 m0" in waits  # a forward after a backward finds its blocks gathered
    gloo = from_dict(cluster_dict(intra__reduce_scatter_busbw_gbs=5))  # an all-reduce: half the bus bandwidth
    slow = simulate(cfg("--parallel.microbatches", "4"), gloo, keep_events=True)
    rs_gloo = [e["end"] - e["start"] for e in last_iteration(slow.events[0]) if e["name"] == "RS c0"][0]
    assert rs_gloo - waits["RS c0"] == pytest.approx(sum(n * 4 / 2 / 10e9 for n in units), rel=1e-6)
    assert r.step_time > simulate(build_config([*GPT2, "--parallel.dp", "2", "--parallel.pp", "2"]), c).step_time


def test_on_shared_cores_a_pass_holds_one_gathered_block_not_two():
    """foldtrain turns FSDP2's backward prefetch off on gloo (foldtrain/parallel/fsdp_gloo.py): with many
    activations alive (GPipe's last forward) the peak is a pass's gathered blocks beside the root."""
    s = resolve_setup(cfg("--parallel.schedule", "gpipe", "--parallel.microbatches", "4"))
    sched = build_schedule("gpipe", 2, 1, 4)
    blocks, root = units(s, 0)
    act = {0: 1e9}
    gpu, cpu = (peak_buffers(s, sched, 0, act, {0: blocks}, {0: root}, thread) for thread in (False, True))
    assert gpu[0] == cpu[0] == 4e9
    one = blocks / s.layers[0] * s.weight_bytes
    assert (gpu[1], cpu[1]) == pytest.approx((root * s.weight_bytes + 2 * one, root * s.weight_bytes + one))


def test_every_rank_holds_fp32_shards_and_its_chunks_unsharded_until_their_lr():
    c = from_dict(cluster_dict())
    r = simulate(cfg("--parallel.schedule", "gpipe", "--train.seq_len", "16"), c, check_memory=False)
    s = r.setup
    for p, m in enumerate(r.memory):
        n = segment_params(s, p)
        assert (m["params"], m["grads"], m["optimizer"], m["masters"]) == pytest.approx((2 * n, 2 * n, 4 * n, 0))
    # rank 0 at its first backward's end (three micro-batches' activations left): the root and blocks gathered
    # and their fp32 gradients; at its LR each unit is resharded as its fp32 reduce-scatter input is filled:
    # with fp32 weights that adds nothing, with bf16 ones (bf16-master) the root's 2 more bytes per parameter
    root = segment_params(s, 0) - s.layers[0] * block_params(s)
    blocks = s.layers[0] * block_params(s)
    assert r.memory[0]["comm_buffers"] == pytest.approx((root + blocks) * (4 + 4))
    assert r.memory[0]["activations"] > 0
    half_cfg = cfg("--parallel.schedule", "gpipe", "--train.seq_len", "16", "--precision", "bf16-master")
    half = simulate(half_cfg, c, check_memory=False)
    assert half.memory[0]["masters"] == 0 and half.memory[0]["params"] == pytest.approx(2 * segment_params(s, 0))
    assert half.memory[0]["comm_buffers"] == pytest.approx((root + blocks) * (2 + 4) + root * 2)
    assert half.memory[0]["activations"] == 0
    allreduce = simulate(build_config([*GPT2, "--parallel.dp", "2", "--parallel.pp", "2"]), c, check_memory=False)
    state = ("params", "grads", "optimizer")
    assert sum(r.memory[0][k] for k in state) == pytest.approx(sum(allreduce.memory[0][k] for k in state) / 2)


def test_refusals_and_the_planners_candidates():
    bad = ["--fold.defer_reduce", "--parallel.schedule", "fold", "--parallel.virtual", "2"]
    with pytest.raises(ConfigError, match="defer") as e:
        resolve_setup(cfg("--optim.grad_clip", "0", *bad))
    assert "\n" not in str(e.value)
    base = build_config(GPT2)
    layout = dict(dp=2, pp=2, tp=1, virtual=1, schedule="1f1b", dp_sync="after-flush", mb=1, M=8, ac="none")
    # the 3D engine's all-reduce, the distributed optimizer (with a pipeline: its tied state whole or sliced), fsdp
    assert [c["strategy"] for c in _reductions(base, layout, False)] == ["none", "none", "none", "fsdp"]
    assert [c["strategy"] for c in _reductions(base, dict(layout, schedule="zb-h1"), False)][-1] == "fsdp"
    assert [c["strategy"] for c in _reductions(base, dict(layout, pp=1, dp=4), False)] == ["none", "none"]
    assert "fsdp" not in [c["strategy"] for c in _reductions(base, layout, True)]


def test_simulate_prints_an_fsdp_pipeline(capsys):
    args = [*GPT2, "--parallel.dp", "2", "--parallel.pp", "2", "--dp.strategy", "fsdp"]
    assert main(["simulate", "--cluster", "dgx-a100", *args]) == 0
    assert "throughput" in capsys.readouterr().out
    c = dataclasses.replace(from_dict(cluster_dict()), memory=1e6)
    with pytest.raises(ConfigError, match="does not fit"):
        simulate(build_config(args), c)
