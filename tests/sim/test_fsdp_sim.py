"""The simulator's ``--dp.strategy fsdp`` (FSDP2, :mod:`foldtrain.sim.fsdp`): collectives priced from their bytes,
FSDP2's prefetch and one-in-flight reduce-scatter in closed form, sharded memory, and ``foldtrain simulate``."""

from __future__ import annotations

import dataclasses

import pytest

from foldtrain.cli import main
from foldtrain.config import build_config
from foldtrain.errors import ConfigError
from foldtrain.sim.cluster import from_dict, load_cluster
from foldtrain.sim.costs import CostModel, block_params, model_params
from foldtrain.sim.fsdp import (
    Phases,
    backward_start_bytes,
    items,
    phases,
    rank_bytes,
    root_params,
    simulate_fsdp,
    stretched,
    timeline,
    unsharded_bytes,
)
from foldtrain.sim.pipeline_fsdp import on_thread
from foldtrain.sim.setup import resolve_setup
from foldtrain.sim.simulate import simulate, simulate_setup
from tests.sim.conftest import cluster_dict

GPT2 = ["--model.preset", "gpt2-small", "--train.seq_len", "1024"]


def setup(n: int, rows: int = 8, micro: int = 8, *args: str):
    """GPT-2 small under fsdp on ``n`` ranks, ``rows`` rows per rank in micro-batches of ``micro``; the tied weight in
    the root's unit (``--dp.shard_vocab false``) unless ``args`` say otherwise."""
    fsdp = ["--dp.strategy", "fsdp", "--parallel.dp", str(n), "--dp.shard_vocab", "false"]
    return resolve_setup(
        build_config([*GPT2, "--train.global_batch", str(n * rows), "--train.micro_batch", str(micro), *fsdp, *args])
    )


def count(events: list[dict], prefix: str) -> int:
    return sum(e["kind"] == "reduce" and e["name"].startswith(prefix) for e in events)


def test_collectives_cost_their_bytes_over_the_bus_bandwidth():
    """A unit's all-gather moves its parameters in the gathered dtype, its reduce-scatter fp32 gradients:
    ``(N-1)/N x bytes / busbw + (N-1) hops``, on the node's link, or the NIC once the ranks span nodes."""
    c = from_dict(cluster_dict())  # 4 per node: intra 10 GB/s, 10 us; inter 1 GB/s, 50 us
    s = setup(4)
    block, root = block_params(s), root_params(s)
    assert root + s.n_layer * block == model_params(s)
    ph = phases(s, c)
    assert ph.ag_block == pytest.approx(3 / 4 * block * 4 / 10e9 + 3 * 10e-6)
    assert ph.rs_root == pytest.approx(3 / 4 * root * 4 / 10e9 + 3 * 10e-6)
    half = phases(setup(4, 8, 8, "--precision", "bf16-master"), c)  # MixedPrecisionPolicy: bf16 gathered, fp32 reduced
    assert half.ag_block == pytest.approx(3 / 4 * block * 2 / 10e9 + 3 * 10e-6)
    assert (half.rs_block, half.rs_root) == (pytest.approx(ph.rs_block), pytest.approx(ph.rs_root))
    wire = phases(setup(4, 8, 8, "--dp.compression", "bf16"), c)  # the policy's reduce_dtype: bf16 reduce-scatters
    assert wire.rs_block == pytest.approx(3 / 4 * block * 2 / 10e9 + 3 * 10e-6) and wire.ag_block == ph.ag_block
    own = from_dict(cluster_dict(intra__all_gather_busbw_gbs=20, intra__reduce_scatter_busbw_gbs=5))
    assert phases(s, own).ag_block == pytest.approx(3 / 4 * block * 4 / 20e9 + 3 * 10e-6)
    assert phases(s, own).rs_block == pytest.approx(3 / 4 * block * 4 / 5e9 + 3 * 10e-6)
    nodes = phases(setup(8), c)
    assert nodes.ag_block == pytest.approx(7 / 8 * block * 4 / 1e9 + 7 * 50e-6)


def test_the_computes_add_up_to_the_cost_models_passes():
    c = load_cluster("dgx-a100")
    s = setup(8, 16, 8)
    cm, ph = CostModel(s, c), phases(s, c)
    total = sum(it.compute for it in items(s, ph))
    assert total == pytest.approx(s.microbatches * (cm.forward(0) + cm.backward(0)))


def test_fsdp2s_host_work_adds_to_every_units_pass_and_more_to_a_gathering_one():
    """``device.fsdp_unit_us`` on every unit's pass, and ``device.fsdp_root_us`` more on the root's (the
    embedding's forward and backward: the head runs inside the root's, no hooks of its own),
    ``device.fsdp_gather_us`` more where it gathers: every forward (resharded after each backward), a block's
    backward under ``reshard_after_forward``; on a device of its own at full rate."""
    c = dataclasses.replace(load_cluster("dgx-a100"), fsdp_unit=1e-3, fsdp_root=4e-3, fsdp_gather=2e-3)
    none = dataclasses.replace(c, fsdp_unit=0, fsdp_root=0, fsdp_gather=0)
    for again in ("true", "false"):
        s = setup(8, 16, 8, "--dp.reshard_after_forward", again)
        plain = {it.name: it.compute for it in items(s, phases(s, none))}
        extra = {it.name: it.compute - plain[it.name] for it in items(s, phases(s, c))}
        assert extra["F embed mb0"] == pytest.approx(7e-3) and extra["F block 3 mb1"] == pytest.approx(3e-3)
        assert extra["F head mb0"] == 0.0 and extra["B embed mb1"] == pytest.approx(5e-3)
        assert extra["B block 3 mb0"] == pytest.approx(3e-3 if again == "true" else 1e-3)


def hand_phases(**over) -> Phases:
    p = dict(ag_root=1, ag_block=2, rs_root=4, rs_block=3, embed_f=1, block_f=5, head=1, block_b=10, embed_b=1)
    return Phases(**{**p, "optim": 0.5, "before_step": 0.25, "loss": 0.125, **over})


def test_two_blocks_in_closed_form():
    """Worked by hand (see the module docstring): the root's all-gather [0, 1] exposed; block 0's prefetched
    during the embedding [1, 3] (1 waited); block 1's during block 0 [3, 5]; the backward's first during the
    head [13, 15] (1 waited); block 1's backward [15, 25], its reduce-scatter [25, 28] overlapping block 0's
    [25, 35]; block 0's reduce-scatter [35, 38] while the embedding's backward ends at 36, and the root's is
    issued once it is done (one in flight: 2 waited), [38, 42], waited for by the final callback (4)."""
    s = dataclasses.replace(setup(4), n_layer=2, layers=(2,), microbatches=1)
    step, events, waited = timeline(s, hand_phases())
    assert step == pytest.approx(42 + 0.25 + 0.5 + 0.125)
    assert waited == pytest.approx(1 + 1 + 1 + 2 + 4)
    comm = {e["name"]: (e["start"], e["end"]) for e in events if e["kind"] == "reduce"}
    assert comm["all-gather for F block 1 mb0"] == (3, 5)
    assert comm["all-gather for B block 1 mb0"] == (13, 15)
    assert comm["reduce-scatter after B embed mb0"] == (38, 42)
    opt = [e for e in events if e["kind"] == "optim"]
    assert [(e["start"], e["end"]) for e in opt] == [(42.25, 42.75)]


def test_backward_post_prefetch_exposes_each_backward_all_gather():
    """FSDP1's BACKWARD_POST (other systems' runs): a block's backward all-gather is issued once the block after
    it is done with its backward, before that block's reduce-scatter, so the compute waits for all of it. The
    two-block case above: the head [13, 14] prefetches nothing, block 1's all-gather [14, 16] is waited for,
    its backward [16, 26]; block 0's all-gather [26, 28] goes before block 1's reduce-scatter [28, 31] and is
    waited for; block 0's backward [28, 38], its reduce-scatter [38, 41]; the embedding's [38, 39]; the root's
    reduce-scatter once block 0's is done [41, 45]."""
    s = dataclasses.replace(setup(4), n_layer=2, layers=(2,), microbatches=1, backward_prefetch="post")
    step, events, waited = timeline(s, hand_phases())
    spans = {e["name"]: (e["start"], e["end"]) for e in events}
    assert spans["all-gather for B block 1 mb0"] == (14, 16) and spans["B block 1 mb0"] == (16, 26)
    assert spans["all-gather for B block 0 mb0"] == (26, 28) and spans["B block 0 mb0"] == (28, 38)
    assert spans["reduce-scatter after B block 1 mb0"] == (28, 31)
    assert spans["reduce-scatter after B embed mb0"] == (41, 45)
    assert step == pytest.approx(45 + 0.875) and waited == pytest.approx(1 + 1 + 2 + 2 + 2 + 4)
    assert spans["F block 0 mb0"] == (3, 8)  # the forward as before: implicit prefetch


def test_one_reduce_scatter_in_flight():
    """A reduce-scatter longer than a block's backward: FSDP2 makes the compute wait for it before issuing the
    next, so the embedding's backward starts once block 1's is done [25, 40], not after block 0's backward."""
    s = dataclasses.replace(setup(4), n_layer=2, layers=(2,), microbatches=1)
    step, events, waited = timeline(s, hand_phases(rs_block=15))
    assert step == pytest.approx(59 + 0.875)
    spans = {e["name"]: (e["start"], e["end"]) for e in events}
    assert spans["B embed mb0"] == (40, 41)
    assert spans["reduce-scatter after B block 0 mb0"] == (40, 55)
    assert waited == pytest.approx(1 + 1 + 1 + 5 + 14 + 4)


def test_compute_beside_a_collective_runs_slower():
    """``overlap_slowdown`` 1: 1 s of work from 0 beside a collective in [0.5, 1] runs alone to 0.5, at half
    speed to 1 (0.25 done), then alone: it ends at 1.25. In the two-block case above the embedding (1 s of
    work from 1) runs beside block 0's all-gather [1, 3], at half speed, to 3; block 0's forward (5 s of work
    from 3) beside block 1's all-gather [3, 5]: 1 s of it done there, the rest by 9."""
    assert stretched(0.0, 1.0, [(0.5, 1.0)], 1.0) == pytest.approx(1.25)
    assert stretched(0.0, 1.0, [(0.5, 1.0)], 0.0) == pytest.approx(1.0)
    assert stretched(2.0, 1.0, [(0.5, 1.0), (4.0, 5.0)], 1.0) == pytest.approx(3.0)  # collectives elsewhere
    s = dataclasses.replace(setup(4), n_layer=2, layers=(2,), microbatches=1)
    _, events, _ = timeline(s, hand_phases(), slowdown=1.0)
    spans = {e["name"]: (e["start"], e["end"]) for e in events}
    assert spans["F embed mb0"] == pytest.approx((1, 3))
    assert spans["F block 0 mb0"] == pytest.approx((3, 9))
    base, _, _ = timeline(s, hand_phases())
    slow, _, _ = timeline(s, hand_phases(), slowdown=1.0)
    assert slow > base + 1


def test_without_overlap_every_collective_adds():
    """On shared CPU cores (gloo runs FSDP2's collectives on the training thread) nothing overlaps."""
    s = dataclasses.replace(setup(4), n_layer=2, layers=(2,), microbatches=1)
    ph = hand_phases()
    step, _, waited = timeline(s, ph, overlap=False)
    compute = 1 + 2 * 5 + 1 + 2 * 10 + 1
    comm = 1 + 2 * 2 + 2 * 2 + 2 * 3 + 4
    assert waited == pytest.approx(comm)
    assert step == pytest.approx(compute + comm + 0.875)
    cpu = from_dict(cluster_dict(node__shared_cores=2))
    assert "every collective blocks" in simulate_fsdp(s, cpu, check_memory=False).notes[0]


def test_only_the_first_all_gather_and_the_last_reduce_scatters_are_exposed():
    """When every block computes longer than its collectives (GPT-2 small on an A100 node), the step is the
    compute plus, in front, the root's all-gather and what the embedding's short forward leaves of block 0's;
    behind, what the embedding's backward leaves of block 0's reduce-scatter, then the root's."""
    c = load_cluster("dgx-a100")
    s = setup(8, 8, 8)
    ph = phases(s, c)
    assert ph.ag_block + ph.rs_block < ph.block_b and ph.ag_block < min(ph.block_f, ph.head)  # they can hide
    assert ph.embed_f < ph.ag_block and ph.embed_b < ph.rs_block  # the embedding hides little
    compute = sum(it.compute for it in items(s, ph))
    step, _, waited = timeline(s, ph)
    exposed = ph.ag_root + (ph.ag_block - ph.embed_f) + (ph.rs_block - ph.embed_b) + ph.rs_root
    assert waited == pytest.approx(exposed)
    assert step == pytest.approx(compute + exposed + ph.before_step + ph.optim + ph.loss)
    slow = dataclasses.replace(c, intra=dataclasses.replace(c.intra, ag_bw=(c.intra.ag_bw or c.intra.bw) / 50))
    assert timeline(s, phases(s, slow))[0] > step + 20 * ph.ag_block  # exposed once the gathers outlast a block


def test_reshard_after_forward_false_gathers_less_and_holds_more():
    c = load_cluster("dgx-a100")
    again, kept = setup(8, 16, 8), setup(8, 16, 8, "--dp.reshard_after_forward", "false")
    L, M = again.n_layer, again.microbatches
    assert (again.reshard_after_forward, kept.reshard_after_forward, M) == (True, False, 2)
    ev_again, ev_kept = (timeline(s, phases(s, c))[1] for s in (again, kept))
    assert count(ev_again, "all-gather") == M * (2 * L + 1)
    assert count(ev_kept, "all-gather") == M * (L + 1)
    extra = rank_bytes(kept, c)["comm_buffers"] - rank_bytes(again, c)["comm_buffers"]
    assert extra == pytest.approx((L - 2) * block_params(again) * again.weight_bytes)
    slow = dataclasses.replace(c, intra=dataclasses.replace(c.intra, ag_bw=c.intra.bw / 500))  # gathers exposed
    assert timeline(kept, phases(kept, slow))[0] < timeline(again, phases(again, slow))[0]


def test_accumulation_reduce_scatters_once_and_keeps_fp32_gradients_unsharded():
    """foldtrain's no_sync (set_requires_gradient_sync(False)) on all but the last micro-batch."""
    c = load_cluster("dgx-a100")
    one, three = setup(8, 8, 8), setup(8, 24, 8)
    assert three.microbatches == 3
    events = timeline(three, phases(three, c))[1]
    assert count(events, "reduce-scatter") == three.n_layer + 1
    assert count(events, "all-gather") == 3 * (2 * three.n_layer + 1)
    root, block = root_params(one), block_params(one)
    gathered, in_flight = 4 * (root + 2 * block), 4 * block
    # every unit's fp32 gradient accumulated unsharded; fp32 weights: no separate fresh copy
    assert rank_bytes(three, c)["comm_buffers"] == pytest.approx(gathered + 4 * model_params(one) + in_flight)


def test_the_embeddings_backward_holds_three_copies_of_the_tied_gradient():
    """Autograd adds the embedding's dense gradient of the tied weight to the head's out of place: at GPT-2's
    vocabulary (the tied weight 5.4 blocks) that moment is the peak, with a small vocabulary the blocks' is."""
    for vocab, tied_peak in ((50257, True), (8192, False)):
        s = setup(8, 8, 8, "--model.vocab_size", str(vocab))
        root, block, tied = root_params(s), block_params(s), s.vocab * s.d_model
        during_blocks = 4 * (root + 2 * block) + 4 * (root + block) + 4 * block
        at_embedding = 4 * root + 3 * 4 * tied + 4 * block
        assert unsharded_bytes(s) == pytest.approx(max(during_blocks, at_embedding))
        assert (at_embedding > during_blocks) == tied_peak


def test_on_shared_cores_one_block_is_gathered_and_no_reduce_scatter_input_kept():
    """On gloo foldtrain turns FSDP2's backward prefetch off and frees each reduce-scatter's input as it returns
    (foldtrain/parallel/fsdp_gloo.py): one block gathered, not two, and nothing kept beside the embedding's
    backward."""
    gpu = load_cluster("dgx-a100")
    cpu = dataclasses.replace(gpu, shared_cores=2.0)
    assert on_thread(cpu) and not on_thread(gpu)
    for vocab in (50257, 8192):
        s = setup(8, 8, 8, "--model.vocab_size", str(vocab), "--train.seq_len", "2")
        root, block, tied = root_params(s), block_params(s), s.vocab * s.d_model
        # few activations: the peak is the backward's end, with these buffers, on the shared cores too
        assert rank_bytes(s, cpu)["comm_buffers"] == unsharded_bytes(s, thread=True)
        during_blocks = 4 * root + 4 * (root + block) + 4 * block  # the block resharded before its copy-in
        at_embedding = 4 * root + 3 * 4 * tied
        assert unsharded_bytes(s, thread=True) == pytest.approx(max(during_blocks, at_embedding))
        assert unsharded_bytes(s, thread=True) < unsharded_bytes(s)
    kept = setup(8, 8, 8, "--model.vocab_size", "8192", "--dp.reshard_after_forward", "false")
    root, block = root_params(kept), block_params(kept)  # every block stays gathered from its forward
    assert unsharded_bytes(kept, thread=True) == pytest.approx(4 * (root + kept.n_layer * block) + 4 * (root + block))


def test_a_sharded_vocabulary_moves_activations_and_holds_no_tied_copies():
    """--dp.shard_vocab: the tied weight leaves the root's unit (never gathered, its gradient one 1/N slice, never
    reduce-scattered); each micro-batch exchanges rows of activations instead: the embedding's partial sums
    reduce-scattered (forward) and their gradients all-gathered (backward), the head's input all-gathered and
    its gradient reduce-scattered, the ids, the targets and the cross entropy's per-row floats."""
    c = from_dict(cluster_dict())  # intra 10 GB/s, 10 us
    s = setup(4, 8, 8, "--dp.shard_vocab", "true")
    whole = setup(4, 8, 8)
    assert s.shard_vocab and not whole.shard_vocab
    tied = s.vocab * s.d_model
    assert root_params(s) == pytest.approx(root_params(whole) - tied)
    ph = phases(s, c)
    ring = lambda nbytes: 3 / 4 * nbytes / 10e9 + 3 * 10e-6  # noqa: E731
    rows = 4 * 8 * 1024  # every rank's rows
    acts, ids, per_row = rows * 768 * 4, ring(rows * 8), 6 * ring(rows * 4)
    assert (ph.vocab_embed_f, ph.vocab_embed_b) == (pytest.approx(ids + ring(acts)), pytest.approx(ring(acts)))
    assert ph.vocab_head == pytest.approx(ids + 2 * ring(acts) + per_row)
    assert phases(whole, c).vocab_head == 0.0
    events = timeline(s, ph)[1]
    assert count(events, "vocabulary exchange") == 3
    # at the embedding's backward only the root's small parameters: the blocks' moment is the peak
    gpu = load_cluster("dgx-a100")
    root, block = root_params(s), block_params(s)
    during_blocks = 4 * (root + 2 * block) + 4 * (root + block) + 4 * block
    assert unsharded_bytes(s) == pytest.approx(during_blocks)
    assert backward_start_bytes(s) == pytest.approx(4 * (root + block))  # no unsharded tied gradient at the head
    assert backward_start_bytes(whole) == pytest.approx(4 * (root_params(whole) + tied + block))
    assert rank_bytes(s, gpu)["total"] < rank_bytes(whole, gpu)["total"]


def test_the_peak_is_the_backwards_start_or_its_end():
    """One micro-batch: the backward frees the activations as it makes the gradient shards. Many activations (8
    rows of 1,024 tokens): the peak is its start, every activation and no gradient shard; 2 tokens: its end,
    every gradient shard and the units' buffers. With accumulation the unsharded fp32 gradients live throughout:
    all of it at once."""
    c = load_cluster("dgx-a100")
    many, few = setup(8), setup(8, 1, 1, "--train.seq_len", "2")
    start, end = rank_bytes(many, c), rank_bytes(few, c)
    assert start["grads"] == 0 and start["comm_buffers"] == pytest.approx(backward_start_bytes(many))
    assert start["activations"] > 0
    assert end["activations"] == 0 and end["comm_buffers"] == pytest.approx(unsharded_bytes(few))
    assert end["grads"] == pytest.approx(4 * model_params(few) / 8)
    for m, s in ((start, many), (end, few)):
        assert m["total"] == pytest.approx(sum(v for k, v in m.items() if k != "total"))
        other = dataclasses.replace(s, microbatches=2)  # accumulation: gradients, buffers and activations at once
        both = rank_bytes(other, c)
        assert both["grads"] > 0 and both["activations"] > 0 and both["comm_buffers"] == unsharded_bytes(other)


def test_optimizer_state_and_step_are_one_nth():
    c = load_cluster("dgx-a100")
    for n in (2, 8):
        s = setup(n, 8, 8, "--precision", "bf16-master")
        mem = rank_bytes(s, c)
        N = model_params(s)
        assert mem["optimizer"] == pytest.approx(8 * N / n) and mem["params"] == pytest.approx(4 * N / n)
        assert mem["masters"] == 0  # the fp32 shards are the masters
        end = rank_bytes(dataclasses.replace(s, micro_batch=1, seq=2), c)  # few activations: the backward's end
        assert end["grads"] == pytest.approx(4 * N / n)
        no_copy = dataclasses.replace(s, master=False)  # AdamW writes no half copy: FSDP casts at the gather
        assert phases(s, c).optim == pytest.approx(CostModel(no_copy, c).optim(0, 1.0 / n))
    assert phases(setup(8), c).optim < phases(setup(2), c).optim


def test_more_ranks_hold_less_per_rank():
    c = load_cluster("dgx-a100")
    totals = [simulate_setup(setup(n), c).peak_mem for n in (2, 4, 8, 16)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_refusals_are_one_line():
    # with a pipeline or tensor parallelism fsdp is the 3D engine's (tests/sim/test_pipeline_fsdp.py)
    for extra in (["--parallel.pp", "2"], ["--parallel.tp", "2"]):
        cfg = build_config([*GPT2, "--train.global_batch", "8", "--dp.strategy", "fsdp", "--parallel.dp", "2", *extra])
        assert resolve_setup(cfg).strategy == "fsdp-3d"
    small = dataclasses.replace(load_cluster("dgx-a100"), memory=4e9)
    with pytest.raises(ConfigError, match="does not fit: an fsdp rank needs") as e:
        simulate_fsdp(setup(8, 16, 16), small)
    assert "\n" not in str(e.value)
    simulate_fsdp(setup(8, 16, 16), small, check_memory=False)


def test_simulate_reports_throughput_utilisation_and_memory(capsys, tmp_path):
    args = [*GPT2, "--train.global_batch", "64", "--train.micro_batch", "8", "--dp.strategy", "fsdp"]
    assert main(["simulate", "--cluster", "dgx-a100", *args, "--parallel.dp", "8", "--profile", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for line in ("throughput", "MFU", "bubble", "exposed DP", "peak memory", "note: fsdp over 8 ranks"):
        assert line in out, out
    assert (tmp_path / "timeline.json").is_file()
    r = simulate(build_config([*args, "--parallel.dp", "8"]), load_cluster("dgx-a100"), keep_events=True)
    assert r.setup.strategy == "fsdp" and r.tokens_per_s * r.step_time == pytest.approx(64 * 1024)
    assert 0 < r.bubble < 1 and r.exposed_dp > 0 and 0 < r.mfu < 1
