"""Closed forms of the cost model: ring all-reduce, the parameter server's traffic, memory."""

from __future__ import annotations

import dataclasses

import pytest

from foldtrain.config import build_config
from foldtrain.errors import FoldtrainError
from foldtrain.model.presets import PRESETS, analytic_param_count
from foldtrain.sim.cluster import from_dict
from foldtrain.sim.costs import CostModel, model_params, segment_params, stepped_share, tied_params
from foldtrain.sim.setup import resolve_setup
from foldtrain.sim.simulate import RunCosts, simulate

from .conftest import cluster_dict

approx = pytest.approx


def _cfg(*args):
    return build_config(["--model.preset", "gpt2-small", "--train.seq_len", "128", *args])


def test_ring_allreduce_time(cluster):
    # 4 workers on one node (intra link 10 GB/s, 10 us): one reduction of the whole gradient, nothing overlapped
    cfg = _cfg(
        "--dp.strategy",
        "allreduce",
        "--parallel.dp",
        "4",
        "--train.global_batch",
        "4",
        "--dp.fusion_mb",
        "100000",
        "--dp.first_bucket_mb",
        "100000",
        "--dp.cycle_ms",
        "0",
    )  # one bucket: one collective
    r = simulate(cfg, cluster, keep_events=True)
    grad = model_params(r.setup) * 4
    n = 4
    expect = 2 * (n - 1) / n * grad / 10e9 + 2 * (n - 1) * 10e-6 + (n - 1) / n * grad * 3 / 1000e9
    red = [e for e in r.events[0] if e["kind"] == "reduce" and e["step"] == r.events[0][-1]["step"]]
    assert len(red) == 1 and red[0]["end"] - red[0]["start"] == approx(expect, rel=1e-6)
    assert CostModel.ring_allreduce_time(grad, n, 10e9, 10e-6) == approx(expect - (n - 1) / n * grad * 3 / 1000e9)


def test_every_bucket_pays_a_collectives_steps():
    """A collective's step latency (``collective_latency_us``, measured with every rank communicating; the
    point-to-point ``latency_us`` when absent) is paid ``2 (n-1)`` times by each bucket's collective: DDP's
    first 1 MB bucket then ``--dp.bucket_mb``; sharded-ps' first bucket then ``--dp.shard_bucket_mb`` (``n-1``
    by each slice of its reduce-scatter and each bucket's all-gather)."""
    from foldtrain.config.load import tomllib
    from foldtrain.sim.cluster import to_toml

    c = from_dict(cluster_dict(device__memory_gb=1000, intra__collective_latency_us=500.0), "c.toml")
    assert c.intra.coll == approx(500e-6) and c.inter.coll == c.inter.latency  # absent: the p2p latency
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").intra.hop == approx(500e-6)
    n = 4
    for strat, flags in (
        ("ddp", ["--dp.bucket_mb", "100"]),
        ("sharded-ps", ["--dp.shard_bucket_mb", "100", "--dp.shard_slice_mb", "100"]),
        ("allreduce", ["--dp.fusion_mb", "100", "--dp.cycle_ms", "0"]),
    ):
        cfg = _cfg("--dp.strategy", strat, "--parallel.dp", str(n), "--train.global_batch", "4", *flags)
        rc = RunCosts(resolve_setup(cfg), c)
        g = rc.cm.grad_bytes(0)
        k = 1 + -(-(g - 2**20) // (100 * 2**20))  # the first bucket, then 100 MB ones
        assert len(rc.bucket_sizes(0, g)) == k >= 3, strat
        base = RunCosts(resolve_setup(cfg), from_dict(cluster_dict(device__memory_gb=1000), "c.toml"))
        delay = lambda r: sum(ph[1] for ph in r.reduce_phases(0, 0) if ph[0] == "delay")  # noqa: E731
        assert delay(rc) - delay(base) == approx(2 * (n - 1) * k * (500e-6 - c.intra.latency)), strat
    # sharded-ps' reduce-scatter goes in slices (--dp.shard_slice_mb): each pays the n-1 steps; the all-gather does not
    cfg = _cfg(
        "--dp.strategy",
        "sharded-ps",
        "--parallel.dp",
        str(n),
        "--train.global_batch",
        "4",
        "--dp.shard_bucket_mb",
        "100",
    )
    rc = RunCosts(resolve_setup(cfg), c)
    base = RunCosts(resolve_setup(cfg), from_dict(cluster_dict(device__memory_gb=1000), "c.toml"))
    sizes = rc.bucket_sizes(0, rc.cm.grad_bytes(0))
    slices = sum(-(-b // rc.s.slice_bytes) for b in sizes)
    assert slices > len(sizes)
    assert delay(rc) - delay(base) == approx((n - 1) * (slices + len(sizes)) * (500e-6 - c.intra.latency))


def test_parameter_server_link_carries_n_minus_1_workers(cluster):
    for servers, n, senders in ((0, 4, 3), (1, 4, 4), (2, 4, 2)):
        cfg = _cfg(
            "--dp.strategy", "ps", "--parallel.dp", str(n), "--dp.ps_servers", str(servers), "--train.global_batch", "4"
        )
        s = resolve_setup(cfg)
        rc = RunCosts(s, cluster)
        flows = [ph for ph in rc.reduce_phases(0, 0) if ph[0] == "flow"]
        grad = rc.cm.grad_bytes(0)
        assert [f[1][0] for f in flows] == ["srv-in", "srv-out"]
        assert flows[0][3] == approx(senders * grad)  # N-1 colocated, N dedicated (split over K servers)
    # on the same link, the central server is slower than the ring all-reduce at 4 workers
    ps = simulate(_cfg("--dp.strategy", "ps", "--parallel.dp", "4", "--train.global_batch", "4"), cluster)
    ar = simulate(_cfg("--dp.strategy", "allreduce", "--parallel.dp", "4", "--train.global_batch", "4"), cluster)
    assert ps.step_time > ar.step_time


def test_parameter_server_moves_at_the_point_to_point_rate_with_nothing_to_share_the_cores_with():
    """The server's transfers are sends and receives: they run at the link's p2p bandwidth where the cluster
    file gives one, and on shared cores they take no collective's CPU per byte (nobody computes meanwhile):
    the reduction is the same with and without ``node.comm_cpu_ns`` (on a 4-rank loopback calibration that
    CPU made it 2.4x as long as measured)."""
    cfg = _cfg("--dp.strategy", "ps", "--parallel.dp", "4", "--train.global_batch", "4")

    def reduce_s(**over) -> float:
        r = simulate(cfg, from_dict(cluster_dict(**over)), keep_events=True)
        (red,) = [e for e in r.events[0] if e["kind"] == "reduce" and e["step"] == r.events[0][0]["step"]]
        return red["end"] - red["start"]

    ps_bytes = 2 * 3 * simulate(cfg, from_dict(cluster_dict())).memory[0]["grads"]  # in and out, 3 workers
    base = reduce_s()
    assert reduce_s(intra__p2p_gbs=20) == approx(base - ps_bytes / 10e9 + ps_bytes / 20e9, rel=1e-6)
    shared = {"node__shared_cores": 2, "node__comm_cpu_ns": 1.0}
    assert reduce_s(**shared) == approx(reduce_s(node__shared_cores=2), rel=1e-9)


def test_memory_of_gpt2_small_single_process(cluster):
    r = simulate(_cfg("--train.global_batch", "1"), cluster)
    m = r.memory[0]
    n = analytic_param_count(**{k: PRESETS["gpt2-small"][k] for k in ("n_layer", "d_model", "context", "vocab_size")})
    assert m["params"] == approx(4 * n) and m["grads"] == approx(4 * n) and m["optimizer"] == approx(8 * n)
    assert m["comm_buffers"] == 0 and m["masters"] == 0
    # activations: Korthikanti et al., fp32 = twice their 2-byte count, 12 blocks, plus the embedding output and three
    # fp32 (L, V) tensors at the loss's backward; no dropout (no masks) and a fused attention (no scores)
    L, d, b, V = 128, 768, 1, 50257
    per_block = L * b * d * (34 - 2) * 2
    assert m["activations"] == approx(12 * per_block + L * d * 4 + 3 * L * V * 4)


def test_block_activations_drop_what_the_kernels_do_not_keep(cluster):
    """Korthikanti et al.'s count, less the dropout masks without dropout and the scores with a fused kernel;
    foldtrain's autocast keeps the norms' inputs in fp32."""
    L, d, a, b = 128, 768, 12, 1
    base = resolve_setup(_cfg("--train.global_batch", "1"))
    unfused = CostModel(dataclasses.replace(base, attention="unfused", dropout=True), cluster)
    assert unfused.act_bytes_block(False) == approx(L * b * d * (34 + 5 * a * L / d) * 2)  # their formula, fp32
    half = CostModel(dataclasses.replace(base, dtype="bf16", act_bytes=2), cluster)
    assert half.act_bytes_block(False) == approx(L * b * d * (32 + 4))
    other = CostModel(dataclasses.replace(base, dtype="bf16", act_bytes=2, native=False), cluster)
    assert other.act_bytes_block(False) == approx(L * b * d * 32)


def test_sharded_ps_shards_optimizer_and_master_state(cluster):
    one = simulate(_cfg("--train.global_batch", "4"), cluster).memory[0]
    sh = simulate(
        _cfg("--dp.strategy", "sharded-ps", "--parallel.dp", "4", "--train.global_batch", "4"), cluster
    ).memory[0]
    assert sh["optimizer"] == approx(one["optimizer"] / 4)
    # ZeRO-2: gradients and fp32 shard weights 1/4 each; the replica's gradients one bucket at a time, here the
    # embedding's (GPT-2 small's 50257 x 768 fp32: larger than the 4 MB bucket)
    assert sh["grads"] == approx(one["grads"] / 4) and sh["masters"] == approx(one["grads"] / 4)
    assert sh["comm_buffers"] == approx(50257 * 768 * 4)
    # a larger --dp.shard_budget_mb lets the backward hold that much before it waits for the link
    big = simulate(
        _cfg(
            "--dp.strategy",
            "sharded-ps",
            "--parallel.dp",
            "4",
            "--train.global_batch",
            "4",
            "--dp.shard_budget_mb",
            "300",
        ),
        cluster,
    ).memory[0]
    assert big["comm_buffers"] == approx(300 * 2**20) and big["grads"] == sh["grads"]


def test_recomputation_trades_memory_for_time(cluster):
    base = ["--parallel.pp", "2", "--parallel.dp", "2", "--train.global_batch", "16", "--parallel.schedule", "gpipe"]
    plain = simulate(_cfg(*base), cluster, check_memory=False)
    ac = simulate(_cfg(*base, "--ac", "full"), cluster, check_memory=False)
    assert max(m["activations"] for m in ac.memory) < max(m["activations"] for m in plain.memory) / 3
    assert ac.step_time > plain.step_time


def test_fold_keeps_all_microbatches_1f1b_about_p():
    c = from_dict(cluster_dict(device__memory_gb=1000))
    base = ["--parallel.pp", "4", "--train.global_batch", "16"]
    f1 = simulate(_cfg(*base, "--parallel.schedule", "1f1b"), c).memory[0]["activations"]
    gp = simulate(_cfg(*base, "--parallel.schedule", "gpipe"), c).memory[0]["activations"]
    assert gp / f1 == approx(16 / 4, rel=0.05)  # M live micro-batches vs P on rank 0


def test_backward_ratio_scales_the_blocks_backward():
    """A cluster's measured ``backward_ratio`` multiplies a block's forward time; absent, the backward's
    operations are priced one by one (twice the products' FLOPs of the forward); it survives the cluster file
    round trip; calibrate measures a real block's ratio."""
    from foldtrain.calibrate import RATIO_SHAPES, _block_times
    from foldtrain.config.load import tomllib
    from foldtrain.model.gpt import Block, GPTShape
    from foldtrain.sim.cluster import load_cluster, to_toml

    s = resolve_setup(
        _cfg("--train.global_batch", "1", "--parallel.pp", "2")
    )  # segment 1: blocks (and the head's forward)
    base = from_dict(cluster_dict(), "c.toml")
    assert base.backward_ratio == 0.0
    d = cluster_dict()
    d["device"]["backward_ratio"] = 1.3
    c = from_dict(d, "c.toml")
    f, b = CostModel(s, c).forward(1), CostModel(s, c).backward(1)
    blocks = s.layers[1]
    assert b == approx(1.3 * blocks * CostModel(s, c).t_block_f)
    per_op = CostModel(s, base).backward(1) / (blocks * CostModel(s, base).t_block_f)
    assert 1.6 < per_op < 2.6, per_op  # products 2x, attention 2.5x, norms and GELU 1.5x of their forward
    assert f == approx(CostModel(s, base).forward(1))
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").backward_ratio == approx(1.3)
    assert load_cluster("dgx-h100").backward_ratio == 0.0
    fwd, bwd = _block_times(Block, GPTShape, *RATIO_SHAPES[0])
    assert 0.5 < bwd / fwd < 5.0, (fwd, bwd)


def test_loss_buffers_count_the_losss_vocabulary_sized_tensors():
    """``device.loss_buffers`` (3 when absent: the live fp32 (b, L, V) tensors at the loss's backward) sets how many
    the head's rank holds; it survives the cluster file round trip; zero is refused with the field named."""
    from foldtrain.config.load import tomllib
    from foldtrain.sim.cluster import to_toml

    cfg = _cfg("--train.global_batch", "2")
    base = from_dict(cluster_dict(device__memory_gb=1000), "c.toml")
    assert base.loss_buffers == 3.0
    d = cluster_dict(device__memory_gb=1000)
    d["device"]["loss_buffers"] = 6.5
    c = from_dict(d, "c.toml")
    extra = simulate(cfg, c).memory[0]["activations"] - simulate(cfg, base).memory[0]["activations"]
    assert extra == approx(3.5 * 2 * 128 * 50257 * 4)
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").loss_buffers == approx(6.5)
    d["device"]["loss_buffers"] = 0
    with pytest.raises(Exception, match="device.loss_buffers"):
        from_dict(d, "c.toml")


@pytest.mark.parametrize("wire,factor", [("none", 1.0), ("bf16", 0.5)])
def test_a_nodes_nic_carries_the_bytes_the_3d_engine_sends(wire, factor):
    """2 nodes x 2 ranks, pipeline inside a node, data parallel across: the chunks' reductions leave out the
    tied embedding; its head copy crosses the NIC dense, its embedding copy as only the rows of the batch's
    tokens; what the two ends send each other stays inside the node (the head its dense copy, the embedding its
    rows and their indices). ``--dp.compression bf16`` halves every data-parallel byte, not the tie's sends."""
    cfg = build_config(
        [
            "--dp.compression",
            wire,
            "--model.preset",
            "tiny",
            "--model.n_layer",
            "8",
            "--model.d_model",
            "256",
            "--train.global_batch",
            "8",
            "--train.seq_len",
            "32",
            "--parallel.dp",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.microbatches",
            "4",
            "--parallel.virtual",
            "2",
            "--parallel.schedule",
            "fold",
        ]
    )
    s = resolve_setup(cfg)
    rc = RunCosts(s, from_dict(cluster_dict(node__gpus=2)))
    tied = s.vocab * s.d_model * 4
    union = s.vocab * (1 - (1 - 1 / s.vocab) ** (8 * 32))  # rows of 256 uniformly drawn tokens
    node0 = 0.0
    for p in (0, 1):
        for seg in (p, p + 2):
            (flow,) = [ph for ph in rc.reduce_phases(p, seg) if ph[0] == "flow"]
            assert flow[1] == ("nic", 0)
            tie = rc.tie(p, seg)
            expect = rc.cm.grad_bytes(seg) - (tied if tie is not None else 0)
            assert flow[3] * flow[2] == approx(expect * factor)  # a 2-rank ring: each rank sends its gradient once
            node0 += flow[3] * flow[2]
            if tie is None:
                continue
            dp = [ph for ph in tie["dp"] if ph[0] == "flow"]
            assert all(f[1] == ("nic", 0) and f[2] == 1.0 for f in dp)
            sent = [f[3] for f in dp]
            assert sent == (approx([union * s.d_model * 4 * factor]) if seg == 0 else approx([tied * factor]))
            node0 += sum(sent)
            (send,) = [ph for ph in tie["send"] if ph[0] == "flow"]
            expect = union * (s.d_model * 4 + 8) if seg == 0 else tied
            assert send[1] == ("tie", p) and send[3] == approx(expect)  # inside the node
    chunks = sum(rc.cm.grad_bytes(seg) for seg in range(4)) - 2 * tied
    assert node0 == approx((chunks + tied + union * s.d_model * 4) * factor)
    assert node0 / 1e6 == approx(34.2 * factor, abs=0.1)  # a 4-rank ring of both dense copies would send 38.1


def test_sliced_tied_state_reduce_scatters_the_heads_copy_and_sends_slices():
    """--optim.shard_tied (the distributed optimizer steps each dp rank's slice of the tied copies): the head's dense
    copy is reduce-scattered over dp, half a 2-rank ring's bytes, and sends the other end only its slice; the
    embedding's rows are all-reduced and sent as before; the V placement reduce-scatters its sum."""
    base = ["--model.preset", "tiny", "--parallel.dp", "2", "--parallel.pp", "2", "--parallel.virtual", "2"]
    base += ["--train.global_batch", "8", "--train.seq_len", "32", "--optim.distributed", "true"]
    c = from_dict(cluster_dict(node__gpus=2))

    def flows(phases):
        return [ph[3] * ph[2] for ph in phases if ph[0] == "flow"]

    for sched, head in (("fold", (1, 3)), ("zbv", (0, 0))):
        args = [*base, "--parallel.schedule", sched, "--parallel.dp_sync", "per-chunk"]
        whole, sliced = (RunCosts(resolve_setup(_cfg(*args, "--optim.shard_tied", t)), c) for t in ("false", "true"))
        tied = whole.s.vocab * whole.s.d_model * 4
        assert flows(whole.tie(*head)["dp"]) == approx([tied]) and flows(sliced.tie(*head)["dp"]) == approx([tied / 2])
        if sched == "fold":  # the head's message: its dense copy, or its slice; the embedding's rows unchanged
            assert flows(whole.tie(*head)["send"]) == approx([tied])
            assert flows(sliced.tie(*head)["send"]) == approx([tied / 2])
            assert whole.tie(0, 0) == sliced.tie(0, 0)


def test_a_deferred_tied_copy_steps_apart_and_gathers_alone():
    """rules.early_tie: fold with deferral defers the head's chunk on the last pipeline rank, whose sliced tied copy
    (--optim.shard_tied) then steps at the iteration's end; the head segment's all-gather splits into the tied
    copy's, queued among the deferred buckets, and the rest. The embedding's copy lands rows: nothing apart."""
    from foldtrain.schedules import Op, build_schedule, schedule_rules

    def early(defer):
        sched = build_schedule("fold", 2, 4, 4, "per-chunk", defer_reduce=defer, distributed_optimizer=True)
        rules = schedule_rules(sched)
        first = next(i for i, a in enumerate(rules[1].actions) if a.op is Op.FORWARD and a.chunk == 7)
        return [r.early_tie for r in rules], first + len(rules[1].actions)

    (ties, deadline) = early(True)
    assert ties == [{}, {7: deadline}] and early(False)[0] == [{}, {}]
    base = ["--model.preset", "tiny", "--model.n_layer", "8", "--parallel.dp", "2", "--parallel.pp", "2"]
    base += ["--parallel.virtual", "4"]
    base += ["--train.global_batch", "8", "--train.seq_len", "32", "--parallel.schedule", "fold"]
    base += ["--parallel.dp_sync", "per-chunk", "--fold.defer_reduce", "true", "--optim.grad_clip", "0"]
    cfg = _cfg(*base, "--optim.distributed", "true", "--optim.shard_tied", "true")
    c = from_dict(cluster_dict(node__gpus=2))
    rc = RunCosts(resolve_setup(cfg), c)

    def wire(phases):
        return sum(ph[3] * ph[2] for ph in phases or [] if ph[0] == "flow")

    tied = rc.s.vocab * rc.s.d_model * 4
    assert wire(rc.tied_gather(1, 7)) == approx(tied / 2)  # a 2-rank all-gather: half of it crosses
    assert wire(rc.gather(1, 7, without_tied=True)) + tied / 2 == approx(wire(rc.gather(1, 7)))
    assert rc.tied_gather(0, 0) is None and rc.tied_gather(1, 5) is None
    assert simulate(cfg, c).step_time > 0  # the end-of-iteration step apart runs in the event simulation


def test_the_ends_split_the_tied_state_and_gather_the_halves_over_their_pair():
    """The distributed optimizer's default (schedules.splits_tied_state): each end of the pipeline steps half of its
    tied copy (the state held: half, where the copy was whole) and receives the other end's half on the pair's
    link after its step, not over dp; a deferred head's half steps apart at the iteration's end and starts at once.
    Whole where a deferred head could not step early (clipping), with shard_tied, and on the V placement."""
    base = ["--model.preset", "tiny", "--model.n_layer", "8", "--parallel.dp", "2", "--parallel.pp", "2"]
    base += ["--parallel.virtual", "4", "--train.global_batch", "8", "--train.seq_len", "32"]
    base += ["--parallel.dp_sync", "per-chunk", "--optim.distributed", "true"]
    c = from_dict(cluster_dict(node__gpus=2))

    def costs(*args):
        return RunCosts(resolve_setup(_cfg(*base, *args)), c)

    def wire(phases, link=None):
        return sum(ph[3] * ph[2] for ph in phases or [] if ph[0] == "flow" and link in (None, ph[1][0]))

    defer = ["--parallel.schedule", "fold", "--fold.defer_reduce", "true"]
    split, whole = costs(*defer, "--optim.grad_clip", "0"), costs(*defer, "--optim.grad_clip", "1.0")
    assert split.s.tied_halves and not whole.s.tied_halves
    assert not costs(*defer, "--optim.grad_clip", "0", "--optim.shard_tied", "true").s.tied_halves
    assert not costs(*defer, "--optim.grad_clip", "0", "--optim.split_tied", "false").s.tied_halves
    assert not costs("--parallel.schedule", "zbv", "--parallel.virtual", "2").s.tied_halves
    assert costs("--parallel.schedule", "interleaved-1f1b", "--optim.grad_clip", "1.0").s.tied_halves  # no deferral
    s, tied = split.s, tied_params(split.s)
    for seg in (0, 7):  # each end holds the state of half its copy more than the dp slices of the rest
        rest = segment_params(s, seg) - tied
        assert stepped_share(s, seg) * segment_params(s, seg) == approx(rest / 2 + tied / 2)
        assert stepped_share(whole.s, seg) * segment_params(s, seg) == approx(rest / 2 + tied)
    half = tied / 2 * 4
    for p, seg in ((0, 0), (1, 7)):  # the other half arrives on the pair's link, inside the node here
        assert wire(split.pair_gather(p, seg), "tie") == approx(half) and whole.pair_gather(p, seg) is None
        assert wire(split.gather(p, seg)) == approx(wire(whole.gather(p, seg)))  # over dp: the rest alone
    assert wire(split.tied_gather(1, 7)) == approx(half) and not split.tied_gather_queued(1, 7)
    assert split.tied_gather(1, 5) is None and split.pair_gather(1, 5) is None
    assert simulate(_cfg(*base, *defer, "--optim.grad_clip", "0"), c).step_time > 0


def test_calibrate_fits_the_heads_cost_beyond_its_products():
    """Head times made from known per-logit and per-weight costs on top of the cost model's three products are
    fitted back exactly; a cluster with ``head_weight_gelems`` charges the last segment's forward for it."""
    from foldtrain.calibrate import HEAD_SHAPES, fit_head
    from foldtrain.sim.cluster import Cluster, Link

    peak, half, rows_half = 80e9, 6.0, 9.0
    c = Cluster(
        name="t",
        gpus_per_node=1,
        memory=1e15,
        tflops={d: peak for d in ("fp32", "bf16", "fp16")},
        mem_bw=1e30,
        efficiency=1.0,
        half_size=half,
        layer_overhead=0.0,
        intra=Link(1e9, 1e-6),
        inter=Link(1e9, 1e-6),
        rows_half_size=rows_half,
    )
    times = []
    for d, vocab, tokens in HEAD_SHAPES:
        cfg = build_config(
            [
                "--model.n_layer",
                "1",
                "--model.d_model",
                str(d),
                "--model.n_head",
                "4",
                "--model.vocab_size",
                str(vocab),
                "--model.context",
                str(tokens),
                "--train.seq_len",
                str(tokens),
                "--train.global_batch",
                "1",
            ]
        )
        cm = CostModel(resolve_setup(cfg), c)
        times.append(cm.t_head_gemms + tokens * vocab / 240e6 + vocab * d / 0.8e9)
    softmax, weight = fit_head(peak, half, rows_half, times)
    assert softmax == approx(240e6) and weight == approx(0.8e9)
    assert fit_head(peak, half, rows_half, [1e-9, 1e-9]) == (0.0, 0.0)  # nothing beyond the products: the defaults
    # the weight's term lost in the noise (the small shape 3% under the logits' cost alone): the logits' term
    # alone, which a fallback to the memory-bound defaults would lose
    weights = [vocab * d / 0.8e9 for d, vocab, _tokens in HEAD_SHAPES]
    noisy = [times[0] - weights[0], times[1] - weights[1] - 0.03 * HEAD_SHAPES[1][1] * HEAD_SHAPES[1][2] / 240e6]
    softmax, weight = fit_head(peak, half, rows_half, noisy)
    assert weight == 0.0 and softmax == approx(240e6, rel=1e-3)

    cfg = _cfg("--train.global_batch", "1", "--parallel.pp", "2")
    d = cluster_dict()
    base = CostModel(resolve_setup(cfg), from_dict(d, "c.toml"))
    d["device"]["head_weight_gelems"] = 0.5
    more = CostModel(resolve_setup(cfg), from_dict(d, "c.toml"))
    assert more.forward(1) - base.forward(1) == approx(768 * 50257 / 0.5e9)
    assert more.forward(0) == approx(base.forward(0))


def test_the_executors_work_per_action_is_paid_on_each_ranks_timeline():
    """``device.action_overhead_us`` (0 when absent): every action of a pipeline rank's list costs that much of
    the rank's own time, so a rank's step is at least its compute plus its actions' overhead; the data-parallel
    engines (no action list) do not pay it; it survives the cluster file round trip."""
    from foldtrain.config.load import tomllib
    from foldtrain.schedules import build_schedule
    from foldtrain.sim.cluster import to_toml

    args = [
        "--model.preset",
        "tiny",
        "--train.seq_len",
        "32",
        "--train.global_batch",
        "8",
        "--parallel.pp",
        "2",
        "--parallel.virtual",
        "2",
        "--parallel.microbatches",
        "8",
        "--parallel.schedule",
        "fold",
    ]
    base = from_dict(cluster_dict(device__memory_gb=1000), "c.toml")
    ov = 1e-3
    c = from_dict(cluster_dict(device__memory_gb=1000, device__action_overhead_us=ov * 1e6), "c.toml")
    assert base.action_overhead == 0.0 and c.action_overhead == approx(ov)
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").action_overhead == approx(ov)
    r0, r1 = simulate(build_config(args), base, keep_events=True), simulate(build_config(args), c, keep_events=True)
    sched = build_schedule("fold", 2, 2, 8)
    for p in range(2):
        busy0 = sum(e["end"] - e["start"] for e in r0.events[p] if e["kind"] in ("compute", "optim") and e["step"] == 0)
        busy1 = sum(e["end"] - e["start"] for e in r1.events[p] if e["kind"] in ("compute", "optim") and e["step"] == 0)
        n = len(sched.ranks[p])
        # every action's overhead lands in the rank's compute and optimizer spans, except what is left after
        # its last one (+1%: the overhead shifts when the tie's transfer overlaps compute, and that transfer's
        # CPU on the shared cores)
        assert busy0 + n * ov * 0.8 <= busy1 <= busy0 + n * ov * 1.01
        assert r1.step_time >= busy0 + n * ov
    assert r1.step_time > r0.step_time
    dp = [
        "--model.preset",
        "tiny",
        "--train.seq_len",
        "32",
        "--train.global_batch",
        "8",
        "--dp.strategy",
        "allreduce",
        "--parallel.dp",
        "2",
    ]
    assert simulate(build_config(dp), c).step_time == approx(simulate(build_config(dp), base).step_time)


def test_oversubscribed_efficiency_is_a_fraction_of_the_cores():
    """``node.oversubscribed_efficiency`` (1 when absent) survives the cluster file round trip, reaches the
    simulator's shared cores, and slows a 4-rank pipeline on 2 shared cores; above 1 or zero it is refused
    with the field named."""
    from foldtrain.config.load import tomllib
    from foldtrain.sim.cluster import to_toml

    cfg = build_config(
        [
            "--model.preset",
            "tiny",
            "--train.global_batch",
            "8",
            "--train.seq_len",
            "32",
            "--parallel.dp",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.microbatches",
            "4",
            "--parallel.virtual",
            "2",
            "--parallel.schedule",
            "fold",
        ]
    )
    slow = {"device__fp32_tflops": 0.01}  # compute-bound: the cores are the limit
    assert from_dict(cluster_dict(node__shared_cores=2, **slow), "c.toml").oversubscribed == 1.0
    c = from_dict(cluster_dict(node__shared_cores=2, node__oversubscribed_efficiency=0.8, **slow), "c.toml")
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").oversubscribed == approx(0.8)
    assert RunCosts(resolve_setup(cfg), c).cpu_share()[3] == approx(0.8)
    fair = simulate(cfg, from_dict(cluster_dict(node__shared_cores=2, **slow), "c.toml")).step_time
    # 4 ranks (2 simulated x dp 2) on 2 cores; only where both pipeline ranks compute at once (not in the bubble)
    assert 1.05 * fair < simulate(cfg, c).step_time <= fair / 0.8 * 1.001
    for bad in (1.5, 0):
        with pytest.raises(Exception, match="node.oversubscribed_efficiency"):
            from_dict(cluster_dict(node__shared_cores=2, node__oversubscribed_efficiency=bad), "c.toml")


def test_calibrate_measures_the_cores_lost_to_oversubscription():
    """With no more ranks than cores nothing is lost (1, nothing measured); with more, blocks are timed at both
    concurrencies and the fraction is a measured one in (0, 1], from one ratio per block shape."""
    from foldtrain.calibrate import RATIO_SHAPES, measure_oversubscription

    assert measure_oversubscription(2, 2) == (1.0, [])
    eff, ratios = measure_oversubscription(3, 2, rounds=1)
    assert len(ratios) == len(RATIO_SHAPES) and all(0.2 < r < 3.0 for r in ratios), ratios
    assert 0.05 <= eff <= 1.0


def test_data_parallel_buckets_and_the_engines_scalar_all_reduces():
    """The data-parallel engines' buckets are launched as their gradients complete (the fraction of the
    backward, the last bucket at the end); a step ends in the loss all-reduce over every rank, and
    ``sharded-ps`` (each rank holds a shard of the gradient) all-reduces the gradient norm before its
    step; DDP's gradients are whole on every rank: no such meeting. On shared cores every step of a
    collective also takes ``node.collective_cpu_us`` from compute (it survives the file round trip)."""
    from foldtrain.config.load import tomllib
    from foldtrain.sim.cluster import to_toml

    c = from_dict(cluster_dict(device__memory_gb=1000, node__shared_cores=2, node__collective_cpu_us=300.0), "c.toml")
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").collective_cpu == approx(300e-6)
    n = 4

    def cfg_args(n, strat="ddp"):
        return ("--dp.strategy", strat, "--parallel.dp", str(n), "--train.global_batch", "4", "--dp.cycle_ms", "0")

    for strat in ("ddp", "sharded-ps", "allreduce"):
        cfg = _cfg(*cfg_args(n, strat))
        rc = RunCosts(resolve_setup(cfg), c)
        g = rc.cm.grad_bytes(0)
        sizes = rc.bucket_sizes(0, g)
        assert sum(sizes) == approx(g) and sizes[0] == 2**20 and len(sizes) >= 3
        buckets = rc.reduce_buckets(0, 0)
        ready = [f for f, _ in buckets]
        cum = [sum(sizes[: i + 1]) / g for i in range(len(sizes) - 1)]
        assert ready[: len(cum)] == approx(cum) and ready[-1] is None
        ring = 2 * (n - 1) if strat != "sharded-ps" else n - 1
        first = buckets[0][1][0]
        assert first == ("delay", approx(ring * c.intra.coll), approx(ring * 300e-6))
        # the loss all-reduce, then the loop's stop agreement and (logging every step) memory gather
        assert rc.end_of_iteration() == approx(3 * CostModel.tree_latency(n, c.intra.coll))
        assert (rc.before_steps() is None) == (strat != "sharded-ps")
    quiet = _cfg(*cfg_args(n), "--train.log_every", "4", "--checkpoint.on_signal", "false")
    assert RunCosts(resolve_setup(quiet), c).end_of_iteration() == approx(
        1.25 * CostModel.tree_latency(n, c.intra.coll)
    )
    assert rc.reduce_phases(0, 0) == [ph for _, phases in buckets for ph in phases]
    sps = RunCosts(
        resolve_setup(_cfg("--dp.strategy", "sharded-ps", "--parallel.dp", "4", "--train.global_batch", "4")), c
    )
    assert sps.before_steps() == approx(CostModel.tree_latency(n, c.intra.coll))
    one = RunCosts(resolve_setup(_cfg("--train.global_batch", "4")), c)
    assert one.end_of_iteration() is None and one.reduce_buckets(0, 0) == []
    # without shared cores the steps take no CPU from compute
    own = RunCosts(
        resolve_setup(_cfg("--dp.strategy", "ddp", "--parallel.dp", "4", "--train.global_batch", "4")),
        from_dict(cluster_dict(device__memory_gb=1000, node__collective_cpu_us=300.0), "c.toml"),
    )
    assert own.reduce_buckets(0, 0)[0][1][0][2] == 0


def test_distributed_optimizer_shards_moments_and_masters_and_gathers_the_weights(cluster):
    """--optim.distributed in the 3D engine: AdamW's moments and the fp32 masters 1/dp per rank (fp32 weights
    have no masters: the slices are views into them), and each step all-gathers the chunk's weights, which its
    next forward waits for: on a slow link the step is slower than without, on a fast one no slower."""
    base = ("--parallel.dp", "4", "--parallel.pp", "2", "--train.global_batch", "8")
    for prec, masters in (("fp32", 0.0), ("bf16-master", 4.0)):
        one = simulate(_cfg(*base, "--precision", prec), cluster)
        dist = simulate(_cfg(*base, "--precision", prec, "--optim.distributed", "true"), cluster)
        tied = 50257 * 768  # the tied weight's copy at each end: half of it stepped there by every dp rank
        for p in range(2):
            n = one.memory[p]["optimizer"] / 8  # parameters of pipeline rank p
            assert one.memory[p]["masters"] == approx(masters * n)
            assert dist.memory[p]["optimizer"] == approx(8 * ((n - tied) / 4 + tied / 2))
            assert dist.memory[p]["masters"] == approx(masters * ((n - tied) / 4 + tied / 2))
        rc = RunCosts(dist.setup, cluster)
        n0 = rc.cm.grad_bytes(0) / dist.setup.grad_bytes
        assert rc.optim(0, 0) == approx(rc.cm.optim(0, ((n0 - tied) / 4 + tied / 2) / n0))
        key, weight, _bw, _lat = rc.pl.dp_link(0)  # the all-gather, on the reduction stream after the step
        assert rc.gather(0, 0)[-1] == ("flow", key, weight, approx(3 / 4 * (n0 - tied) * dist.setup.weight_bytes))
        assert rc.pair_gather(0, 0)[-1][3] == approx(tied / 2 * dist.setup.weight_bytes)  # the other end's half
        assert RunCosts(one.setup, cluster).gather(0, 0) is None
        # --optim.shard_tied: the tied copies sliced too, and all-gathered with the rest
        tied_sharded = simulate(
            _cfg(*base, "--precision", prec, "--optim.distributed", "true", "--optim.shard_tied", "true"), cluster
        )
        for p in range(2):
            n = one.memory[p]["optimizer"] / 8
            assert tied_sharded.memory[p]["optimizer"] == approx(8 * n / 4)
            assert tied_sharded.memory[p]["masters"] == approx(masters * n / 4)
        rc = RunCosts(tied_sharded.setup, cluster)
        # the embedding's copy is only looked up: the rows of the step's tokens over every dp rank (an all-reduce
        # of fp32 rows), not the whole; the head's copy is all-gathered whole
        st = tied_sharded.setup
        rows = min(50257, st.dp * st.microbatches * st.micro_batch * st.seq)
        looked_up = (n0 - tied) * st.weight_bytes + 2 * rows * 768 * 4
        assert rc.gather(0, 0)[-1] == ("flow", key, weight, approx(3 / 4 * looked_up))
        n1 = rc.cm.grad_bytes(1) / st.grad_bytes
        assert rc.gather(1, 1)[-1][-1] == approx(3 / 4 * n1 * st.weight_bytes)

    # two nodes of two ranks (dp across them) on a slow link: the reduce-scatter and all-gather move the all-reduce's
    # bytes and the all-gather overlaps the next iteration's forwards, so the step is no slower than the default's;
    # the forwards that find their chunk's all-gather unfinished wait for it
    slow = from_dict(cluster_dict(node__gpus=2, inter__bw_gbs=0.2))
    base = ("--parallel.dp", "2", "--parallel.pp", "2", "--train.global_batch", "8", "--parallel.dp_sync", "per-chunk")
    a = simulate(_cfg(*base), slow)
    b = simulate(_cfg(*base, "--optim.distributed", "true"), slow, keep_events=True)
    assert b.step_time <= a.step_time, (a.step_time, b.step_time)
    waits = [e for rank in b.events for e in rank if e["name"].startswith("AG c")]
    assert waits and all(e["end"] > e["start"] for e in waits)


def test_split_backward_prices_i_and_w_from_the_blocks_operations(cluster):
    """A split backward costs what the whole one does: W is the share of the block's weight-gradient products
    and reductions (about half of the products' FLOPs), I the rest; segment 0's I is free and its W whole.
    zb-h1 keeps P micro-batches alive on every rank (1F1B on rank 0 only) and idles less."""
    s = resolve_setup(_cfg("--parallel.pp", "2", "--train.global_batch", "8"))
    cm = CostModel(s, cluster)
    assert 0.3 < cm.w_share < 0.6, cm.w_share
    assert cm.backward_input(1) + cm.backward_weight(1) == approx(cm.backward(1))
    assert cm.backward_weight(1) == approx(s.layers[1] * cm.t_block_b * cm.w_share)
    assert (cm.backward_input(0), cm.backward_weight(0)) == (0.0, approx(cm.backward(0)))
    c = from_dict(cluster_dict(device__memory_gb=1000))
    base = ["--parallel.pp", "4", "--train.global_batch", "16"]
    one, zb = (simulate(_cfg(*base, "--parallel.schedule", n), c) for n in ("1f1b", "zb-h1"))
    act = [[m["activations"] for m in r.memory] for r in (one, zb)]
    per_mb = act[0][1] - act[0][2]  # a micro-batch of a middle rank's blocks: 1F1B keeps 3 on rank 1, 2 on rank 2
    assert act[1][:3] == approx([act[0][0], 4 * per_mb, 4 * per_mb])  # zb-h1: 4 everywhere
    assert act[1][3] - act[0][3] == approx(3 * per_mb)  # the last rank: 4 instead of 1 (its loss buffers alike)
    from foldtrain.sim.cluster import load_cluster

    gpu = ["--model.preset", "gpt2-medium", *base, "--train.micro_batch", "1"]
    one, zb = (simulate(_cfg(*gpu, "--parallel.schedule", n), load_cluster("dgx-a100")) for n in ("1f1b", "zb-h1"))
    assert zb.step_time < 0.95 * one.step_time  # the W fill 1F1B's cool-down


def test_zbv_places_both_tie_ends_on_rank_0_and_the_turn_on_the_last_rank(cluster):
    """The V placement in the simulator, as the executor runs it: rank 0 holds the first and the last segment (the
    embedding, the head and the loss buffers), its tied copies are reduced over dp and added there (no send), and the
    turn on rank P-1 moves nothing; the step predicts no faster than the loop placement's interleaved-zb by more
    than its smaller bubble allows."""
    c = from_dict(cluster_dict(device__memory_gb=1000))
    base = ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.virtual", "2", "--train.global_batch", "16"]
    v = simulate(_cfg(*base, "--parallel.schedule", "zbv", "--parallel.dp_sync", "per-chunk"), c)
    loop = simulate(_cfg(*base, "--parallel.schedule", "interleaved-zb", "--parallel.dp_sync", "per-chunk"), c)
    costs = RunCosts(v.setup, c)
    # one dp reduction of the dense sum, at the embedding end; the head end reduces nothing
    assert costs.tie(0, 0)["send"] == [] and costs.tie(0, 3) == {"dp": [], "send": []} and costs.tie(0, 0)["dp"]
    # rank 0 holds both tied copies (the loop placement: one on each rank), the same blocks' share otherwise
    tied = 50257 * 768 * 4
    assert v.memory[0]["params"] - v.memory[1]["params"] == approx(2 * tied, rel=0.05)
    assert loop.memory[0]["params"] - loop.memory[1]["params"] == approx(0, abs=0.05 * tied)
    assert 0.5 < v.step_time / loop.step_time < 1.5


@pytest.mark.parametrize("strategy", ["allreduce", "ddp"])
def test_compression_halves_a_data_parallel_strategys_link_bytes(cluster, strategy):
    """``--dp.compression bf16`` puts half of every gradient byte on the link (``ring``'s flow), as the strategy
    does with its buckets; the rest of the reduction (its steps, the sum in memory) stays."""
    base = ["--dp.strategy", strategy, "--parallel.dp", "4", "--train.global_batch", "4"]
    flows = []
    for wire in ("none", "bf16"):
        rc = RunCosts(resolve_setup(_cfg(*base, "--dp.compression", wire)), cluster)
        flows.append([ph[3] for ph in rc.ring(0, 1e6) if ph[0] == "flow"])
    assert flows[1] == approx([f / 2 for f in flows[0]]) and flows[0][0] > 0


def test_meetings_wait_behind_the_interface_queue_only_where_they_cross_nodes():
    """``inter.queue_ms`` (a FIFO ahead of a small message; the emulated cluster's tbf latency) applies to a meeting
    whose collective crosses nodes: the loss all-reduce over every rank; the pipeline's gradient norm inside a node
    does not, the distributed optimizer's (over every rank) does. The calibrated emulated network carries the
    shaper's queue."""
    from foldtrain.calibrate.comm import links
    from foldtrain.config.load import tomllib
    from foldtrain.netem.cluster import QUEUE_MS
    from foldtrain.sim.cluster import to_toml

    c = from_dict(cluster_dict(node__gpus=2, inter__queue_ms=50.0), "c.toml")
    assert c.inter.queue == approx(0.05) and c.intra.queue == 0.0
    assert from_dict(tomllib.loads(to_toml(c)), "c.toml").inter.queue == approx(0.05)
    base = ("--parallel.dp", "2", "--parallel.pp", "2", "--train.global_batch", "8", "--parallel.virtual", "2")
    fold = ("--parallel.schedule", "fold", "--parallel.dp_sync", "per-chunk", "--optim.grad_clip", "0")
    rc = RunCosts(resolve_setup(_cfg(*base, *fold, "--fold.defer_reduce")), c)
    assert [rc.queue_cap(m) for m in ("loss", "clip")] == approx([0.05, 0.0])
    assert rc.before_steps() is None  # deferral without clipping: no norm
    dist = RunCosts(resolve_setup(_cfg(*base, *fold, "--optim.distributed", "true")), c)
    assert dist.queue_cap("clip") == approx(0.05)
    assert dist.before_steps() == approx(CostModel.tree_latency(4, c.inter.coll))  # the norm over every shard
    one_node = RunCosts(resolve_setup(_cfg(*base, *fold)), from_dict(cluster_dict(inter__queue_ms=50.0), "c.toml"))
    assert [one_node.queue_cap(m) for m in ("loss", "clip")] == [0.0, 0.0]
    probe = {"allreduce_bw": 1e8, "latency_s": 1e-4}
    intra, inter = links(probe, probe)
    assert inter.queue == approx(QUEUE_MS / 1e3) and intra.queue == 0.0
    assert links(probe, None)[1].queue == 0.0  # loopback only: no shaper


def test_the_calibrated_work_per_action_reproduces_the_probe_it_came_from():
    """``calibrate`` measures the executor's work per action with a negligible pipeline of 2 replicas (4 ranks);
    on 2 shared cores every core-second of it takes more than a second of the step there, so the overhead it
    writes is the one with which the simulator's step of the probe is the measured step, not the measured
    excess divided by the actions (which the simulator would stretch again)."""
    import dataclasses

    from foldtrain.calibrate.executor import EXECUTOR_PROBE, solve_overhead
    from foldtrain.schedules import build_schedule

    cfg = build_config([*EXECUTOR_PROBE, "--parallel.dp", "2", "--train.global_batch", "32"])
    shared = from_dict(cluster_dict(device__memory_gb=1000, node__gpus=4, node__shared_cores=2), "c.toml")

    def simulated(ov: float) -> float:
        return simulate(cfg, dataclasses.replace(shared, action_overhead=ov)).step_time

    lo = simulated(0.0)
    actions = max(len(a) for a in build_schedule("interleaved-1f1b", 2, 2, 16).ranks)
    measured = lo + actions * 1e-3  # 1 ms of the step per action
    ov = solve_overhead(measured, simulated)
    assert simulated(ov) == approx(measured, rel=1e-3)
    assert 0.3e-3 < ov < 0.7e-3  # four ranks on two cores: each core-second of it costs about two of the step
    assert solve_overhead(lo * 0.9, simulated) == 0.0  # a step the simulator already exceeds: no overhead
    # where each action costs the step its own time (a core per rank): the excess per action
    assert solve_overhead(measured, lambda ov: lo + actions * ov) == approx(1e-3)
    with pytest.raises(FoldtrainError, match="does not grow"):  # a simulator that ignored it: no answer, said
        solve_overhead(measured, lambda ov: lo)
