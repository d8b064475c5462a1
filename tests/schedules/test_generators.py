"""Generators: compute orders, communication and reduction insertion, config errors."""

import doctest
import itertools

import pytest

import foldtrain.schedules as schedules_pkg
from foldtrain.errors import ConfigError
from foldtrain.schedules import (
    Action,
    GatherRelease,
    Op,
    activations_peak,
    build_schedule,
    chunks_of_rank,
    format_schedule,
    local_chunk,
    message_key,
    rank_rules,
    stage_rank,
    validate_schedule,
)

VARIANTS = [("after-flush", False), ("per-chunk", False), ("per-chunk", True)]


def valid_shapes(name):
    for pp, v, m in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 4, 8)):
        if name == "1f1b" and v != 1:
            continue
        if name == "interleaved-1f1b" and (v < 2 or m % pp):
            continue
        yield pp, v, m


GRID = [(n, *shape) for n in ("gpipe", "1f1b", "interleaved-1f1b", "fold") for shape in valid_shapes(n)]


def compute_str(sched, rank):
    return " ".join(str(a) for a in sched.compute_only(rank))


def test_fold_required_order():
    s = build_schedule("fold", 2, 2, 2)
    assert compute_str(s, 0) == "F(c0,m0) F(c0,m1) F(c2,m0) F(c2,m1) B(c2,m1) B(c2,m0) B(c0,m1) B(c0,m0)"
    assert compute_str(s, 1) == "F(c1,m0) F(c1,m1) F(c3,m0) F(c3,m1) B(c3,m1) B(c3,m0) B(c1,m1) B(c1,m0)"


@pytest.mark.parametrize("name,pp,v,m", GRID)
def test_every_schedule_validates(name, pp, v, m):
    for dp_sync, defer in VARIANTS:
        if defer and name != "fold":
            continue
        s = build_schedule(name, pp, v, m, dp_sync, defer)
        assert (s.name, s.pp, s.virtual, s.microbatches, s.dp_sync, s.defer_reduce) == (name, pp, v, m, dp_sync, defer)
        validate_schedule(s)  # strict: one channel per direction
        validate_schedule(s, channels="per-kind")


def test_placement_helpers():
    assert [stage_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [local_chunk(s, 4) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert chunks_of_rank(1, 4, 3) == [1, 5, 9]


def test_gpipe_order():
    s = build_schedule("gpipe", 2, 2, 2)
    assert compute_str(s, 0) == "F(c0,m0) F(c2,m0) F(c0,m1) F(c2,m1) B(c2,m1) B(c0,m1) B(c2,m0) B(c0,m0)"
    s = build_schedule("gpipe", 2, 1, 3)
    assert compute_str(s, 1) == "F(c1,m0) F(c1,m1) F(c1,m2) B(c1,m2) B(c1,m1) B(c1,m0)"


def test_1f1b_order():
    s = build_schedule("1f1b", 4, 1, 6)
    assert compute_str(s, 0) == (
        "F(c0,m0) F(c0,m1) F(c0,m2) F(c0,m3) B(c0,m0) F(c0,m4) B(c0,m1) F(c0,m5) B(c0,m2) B(c0,m3) B(c0,m4) B(c0,m5)"
    )
    assert compute_str(s, 3) == " ".join(f"F(c3,m{i}) B(c3,m{i})" for i in range(6))


def test_1f1b_fewer_microbatches_than_stages():
    s = build_schedule("1f1b", 4, 1, 2)  # legal: early ranks never reach the steady state
    assert compute_str(s, 0) == "F(c0,m0) F(c0,m1) B(c0,m0) B(c0,m1)"
    validate_schedule(s)


def test_interleaved_matches_megatron_mapping():
    pp, v, m = 4, 2, 8
    s = build_schedule("interleaved-1f1b", pp, v, m)
    for p in range(pp):
        comp = s.compute_only(p)
        fwd = [a for a in comp if a.op is Op.FORWARD]
        bwd = [a for a in comp if a.op is Op.BACKWARD]
        for k, a in enumerate(fwd):
            assert (a.chunk, a.mb) == (((k // pp) % v) * pp + p, (k // (pp * v)) * pp + k % pp)
        for k, a in enumerate(bwd):
            assert (a.chunk, a.mb) == ((v - 1 - (k // pp) % v) * pp + p, (k // (pp * v)) * pp + k % pp)
        warmup = min((pp - p - 1) * 2 + (v - 1) * pp, v * m)
        assert [a.op for a in comp[:warmup]] == [Op.FORWARD] * warmup
        assert comp[warmup].op is Op.FORWARD and comp[warmup + 1].op is Op.BACKWARD
    s = build_schedule("interleaved-1f1b", 2, 2, 2)
    assert compute_str(s, 0) == "F(c0,m0) F(c0,m1) F(c2,m0) F(c2,m1) B(c2,m0) B(c2,m1) B(c0,m0) B(c0,m1)"


def test_comm_conventions():
    s = build_schedule("fold", 2, 2, 1)
    assert [str(a) for a in s.ranks[0]] == [
        "F(c0,m0)", "SA(c0,m0->1)",
        "RA(c2,m0<-1)", "F(c2,m0)", "SA(c2,m0->1)",
        "RG(c2,m0<-1)", "B(c2,m0)", "SG(c2,m0->1)",
        "RG(c0,m0<-1)", "B(c0,m0)",
        "LR(c2)", "LR(c0)", "WR(c2)", "WR(c0)", "OS(c2)", "OS(c0)",
    ]  # fmt: skip
    assert [str(a) for a in s.ranks[1]][:6] == [
        "RA(c1,m0<-0)", "F(c1,m0)", "SA(c1,m0->0)", "RA(c3,m0<-0)", "F(c3,m0)", "B(c3,m0)",
    ]  # fmt: skip
    # a send names its (local) producer, a recv its (local) consumer; the key joins them
    assert message_key(Action(Op.SEND_ACT, 1, 0, 0)) == message_key(Action(Op.RECV_ACT, 2, 0, 1)) == ("act", 1, 0)
    assert message_key(Action(Op.SEND_GRAD, 3, 0, 0)) == message_key(Action(Op.RECV_GRAD, 2, 0, 1)) == ("grad", 3, 0)


def test_single_rank_has_no_comms():
    for name, v in (("gpipe", 3), ("1f1b", 1), ("interleaved-1f1b", 2), ("fold", 3)):
        s = build_schedule(name, 1, v, 4)
        assert not [a for a in s.ranks[0] if a.op in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)]
        validate_schedule(s)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 2), (4, 8)])
def test_activation_peaks(pp, m):
    s = build_schedule("1f1b", pp, 1, m)
    for p in range(pp):
        assert activations_peak(s, p) == min(pp - p, m) <= pp - p
    for v in (1, 2, 3):
        for name in ("fold", "gpipe"):
            s = build_schedule(name, pp, v, m)
            assert [activations_peak(s, p) for p in range(pp)] == [v * m] * pp


def reduce_positions(actions, op):
    return {a.chunk: i for i, a in enumerate(actions) if a.op is op}


@pytest.mark.parametrize(
    "name,pp,v,m", [("fold", 4, 2, 4), ("interleaved-1f1b", 4, 2, 4), ("1f1b", 2, 1, 3), ("gpipe", 2, 3, 2)]
)
def test_per_chunk_launch_right_after_last_backward(name, pp, v, m):
    s = build_schedule(name, pp, v, m, "per-chunk")
    for p, acts in enumerate(s.ranks):
        lr = reduce_positions(acts, Op.LAUNCH_REDUCE)
        for c in chunks_of_rank(p, pp, v):
            last_b = max(i for i, a in enumerate(acts) if a.op is Op.BACKWARD and a.chunk == c)
            nxt = acts[last_b + 1]
            expect = last_b + 2 if nxt.op is Op.SEND_GRAD else last_b + 1
            if nxt.op is Op.SEND_GRAD:
                assert (nxt.chunk, nxt.mb) == (c, acts[last_b].mb)
            assert lr[c] == expect, f"rank {p} c{c}: {format_schedule(s, all_actions=True)}"
        # waits and steps at the end: all WR, then all OS, in the order chunks finished
        tail = acts[-2 * v :]
        order = sorted(lr, key=lr.get)
        assert tail == [Action(Op.WAIT_REDUCE, c) for c in order] + [Action(Op.OPTIM_STEP, c) for c in order]


def test_fold_per_chunk_overlaps_all_but_chunk0():
    s = build_schedule("fold", 4, 3, 4, "per-chunk")
    for p, acts in enumerate(s.ranks):
        lr = reduce_positions(acts, Op.LAUNCH_REDUCE)
        segs = chunks_of_rank(p, 4, 3)
        assert sorted(lr, key=lr.get) == segs[::-1]  # chunk V-1 finishes first
        first_b0 = min(i for i, a in enumerate(acts) if a.op is Op.BACKWARD and a.chunk == segs[0])
        assert all(lr[c] < first_b0 for c in segs[1:])  # launched while chunk 0's backward still runs


def test_after_flush_reductions_at_the_end():
    s = build_schedule("interleaved-1f1b", 2, 3, 4)
    for acts in s.ranks:
        last = max(i for i, a in enumerate(acts) if a.op in (Op.FORWARD, Op.BACKWARD, Op.SEND_GRAD, Op.SEND_ACT))
        assert [a.op for a in acts[last + 1 :]] == [Op.LAUNCH_REDUCE] * 3 + [Op.WAIT_REDUCE] * 3 + [Op.OPTIM_STEP] * 3


def test_defer_reduce_placement():
    pp, v, m = 2, 3, 2
    s = build_schedule("fold", pp, v, m, "per-chunk", defer_reduce=True)
    for p, acts in enumerate(s.ranks):
        segs = chunks_of_rank(p, pp, v)
        assert s.deferred_chunks(p) == segs[1:]  # local chunk 0 finishes last: waited at the end
        for c in segs[1:]:
            first = min(i for i, a in enumerate(acts) if a.op in (Op.RECV_ACT, Op.FORWARD) and a.chunk == c)
            assert acts[first - 2 : first] == [Action(Op.WAIT_REDUCE, c), Action(Op.OPTIM_STEP, c)]
            assert acts[first].op is Op.RECV_ACT  # with pp > 1 every chunk after 0 receives its input
        assert acts[-2:] == [Action(Op.WAIT_REDUCE, segs[0]), Action(Op.OPTIM_STEP, segs[0])]
    s1 = build_schedule("fold", 1, 2, 2, "per-chunk", defer_reduce=True)  # no recvs: before the F
    assert [str(a) for a in s1.ranks[0][:5]] == ["F(c0,m0)", "F(c0,m1)", "WR(c1)", "OS(c1)", "F(c1,m0)"]
    assert build_schedule("fold", 2, 1, 2, "per-chunk", True).deferred_chunks(0) == []  # V=1: nothing to defer


def test_the_distributed_optimizer_steps_deferred_chunks_a_chunk_ahead():
    """With the distributed optimizer a deferred chunk's WR, OS go before the forwards of the local chunk
    before it (its step's all-gather then overlaps them); the compute, the deferred set and validity stay."""
    pp, v, m = 2, 4, 4
    plain = build_schedule("fold", pp, v, m, "per-chunk", True)
    ahead = build_schedule("fold", pp, v, m, "per-chunk", True, distributed_optimizer=True)
    assert (
        build_schedule("fold", pp, v, m, "per-chunk", False, distributed_optimizer=True).ranks
        == build_schedule("fold", pp, v, m, "per-chunk").ranks
    )  # nothing deferred: nothing moves
    for p in range(pp):
        segs = chunks_of_rank(p, pp, v)
        assert compute_str(ahead, p) == compute_str(plain, p) and ahead.deferred_chunks(p) == segs[1:]
        acts = ahead.ranks[p]
        for before, c in zip(segs, segs[1:]):
            first = min(i for i, a in enumerate(acts) if a.op in (Op.RECV_ACT, Op.FORWARD) and a.chunk == before)
            assert acts[first - 2 : first] == [Action(Op.WAIT_REDUCE, c), Action(Op.OPTIM_STEP, c)]
        validate_schedule(ahead)


@pytest.mark.parametrize(
    "name, sync, defer",
    [("fold", "per-chunk", False), ("interleaved-1f1b", "after-flush", False), ("fold", "per-chunk", True)],
)
def test_the_all_gathers_go_in_the_order_of_the_next_forwards(name, sync, defer):
    """rules.gather_order: a rank's non-deferred chunks by first forward. Fold and interleaved step the last chunk
    first (its reduction lands first), so each step holds its all-gather back until every chunk before it in that
    order has stepped (GatherRelease): the first chunk's then goes first on the dp group, whose collectives run in
    issue order. A deferred chunk's starts at its own step."""
    pp, v, m = 2, 4, 4
    sched = build_schedule(name, pp, v, m, sync, defer, distributed_optimizer=True)
    for p in range(pp):
        rules = rank_rules(sched, p)
        segs = chunks_of_rank(p, pp, v)
        assert rules.gather_order == (tuple(segs[:1]) if defer else tuple(segs))
        steps = [a.chunk for a in sched.ranks[p] if a.op is Op.OPTIM_STEP]
        release = GatherRelease(rules.gather_order)
        started = [release.step(c) for c in steps]
        if defer:  # the deferred chunks step before their forwards, each starting its own
            assert started == [[c] for c in steps]
        else:  # the last chunk steps first: nothing starts until the first chunk's step starts them all, in order
            assert steps == segs[::-1] and started == [[]] * (len(segs) - 1) + [segs]


def test_format_schedule():
    text = format_schedule(build_schedule("1f1b", 2, 1, 2, "per-chunk"))
    assert text.splitlines() == [
        "1f1b: pp=2 virtual=1 microbatches=2 dp_sync=per-chunk",
        "rank 0: F(c0,m0) F(c0,m1) B(c0,m0) B(c0,m1)",
        "rank 1: F(c1,m0) B(c1,m0) F(c1,m1) B(c1,m1)",
    ]
    full = format_schedule(build_schedule("1f1b", 2, 1, 1), all_actions=True)
    assert "rank 1: RA(c1,m0<-0) F(c1,m0) B(c1,m0) SG(c1,m0->0) LR(c1) WR(c1) OS(c1)" in full
    assert str(Action(Op.LAUNCH_REDUCE, 2)) == "LR(c2)" and str(Op.FORWARD) == "F"


@pytest.mark.parametrize(
    "args,needle",
    [
        (("zb-v", 2, 1, 4), "gpipe, 1f1b, interleaved-1f1b, fold"),
        (("interleaved-1f1b", 2, 1, 4), "needs --parallel.virtual >= 2"),
        (("1f1b", 2, 2, 4), "use interleaved-1f1b or fold for virtual > 1"),
        (("interleaved-1f1b", 4, 2, 6), "multiple of --parallel.pp 4"),
        (("interleaved-1f1b", 4, 2, 2), "use 4 micro-batches"),
        (("interleaved-1f1b", 4, 2, 6), "use 4 or 8 micro-batches"),
        (("gpipe", 2, 1, 4, "after-flush", True), "only applies to --parallel.schedule fold"),
        (("fold", 2, 2, 4, "after-flush", True), "needs --parallel.dp_sync per-chunk"),
        (("fold", 2, 2, 4, "sometimes"), "after-flush, per-chunk"),
        (("fold", 0, 2, 4), "--parallel.pp must be a positive integer"),
        (("fold", 2, 0, 4), "--parallel.virtual must be a positive integer"),
        (("gpipe", 2, 1, 0), "--parallel.microbatches must be a positive integer"),
        (("gpipe", 2, 1.5, 1), "--parallel.virtual"),
    ],
)
def test_config_errors(args, needle):
    with pytest.raises(ConfigError) as e:
        build_schedule(*args)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and ";" in msg  # one line: problem; fix


def test_package_doctest():
    assert doctest.testmod(schedules_pkg, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0
