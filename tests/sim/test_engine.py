"""The event engine against closed forms: pipeline bubbles, fold's makespan, link sharing."""

from __future__ import annotations

import pytest

from foldtrain.profile import summarize
from foldtrain.schedules import build_schedule
from foldtrain.sim import UnitCosts, events_from_simulation, simulate_order
from foldtrain.sim.events import Sim, run_schedule

approx = pytest.approx


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 3), (3, 7)])
def test_gpipe_1f1b_bubble(name, pp, m):
    s = summarize(events_from_simulation(simulate_order(build_schedule(name, pp, 1, m), 1.0, 2.0)))[0]
    assert s["bubble"] == approx([(pp - 1) / (m + pp - 1)] * pp)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 4), (4, 4, 8), (3, 2, 6)])
def test_fold_makespan_free_communication(pp, v, m):
    t_f, t_b = 1.5, 2.5
    sim = run_schedule(build_schedule("fold", pp, v, m), UnitCosts(t_f, t_b))
    assert sim.iter_end[0] == approx((v * m + pp - 1) * (t_f + t_b))


def test_per_chunk_exposes_only_the_last_chunk_reduction():
    costs = UnitCosts(1.0, 2.0, t_reduce=3.0)
    flush = run_schedule(build_schedule("fold", 2, 4, 4, "after-flush"), costs)
    chunk = run_schedule(build_schedule("fold", 2, 4, 4, "per-chunk"), costs)
    compute_end = (4 * 4 + 1) * 3.0
    assert flush.iter_end[0] == approx(compute_end + 4 * 3.0)  # 4 chunk reductions after the flush
    assert chunk.iter_end[0] == approx(compute_end + 3.0)  # only chunk 0's


def test_deferred_reduction_is_waited_in_the_next_iteration():
    costs = UnitCosts(1.0, 2.0, t_reduce=2.0, t_optim=0.5)
    sim = run_schedule(build_schedule("fold", 2, 2, 4, "per-chunk", defer_reduce=True), costs, iterations=3)
    waits = [e for e in sim.ranks[0].events if e["kind"] == "reduce_wait" and e["args"]["deferred"]]
    optims = [e for e in sim.ranks[0].events if e["kind"] == "optim"]
    assert not [e for e in waits if e["step"] == 0]  # nothing launched before the first iteration
    assert len([e for e in optims if e["step"] == 0]) == 1 and len([e for e in optims if e["step"] == 2]) == 2


class _Deadlines(UnitCosts):
    """Deferred chunks reduce in three buckets of 9 s each (more than the backward between two LRs:
    a backlog); urgent ones in 10 s."""

    def deferred_buckets(self, p, c):
        return [[("delay", 9.0)] for _ in range(3)]


def test_deferred_buckets_never_delay_an_urgent_reduction():
    """fold + deferral: the deferred buckets go one at a time and none starts while an urgent reduction
    is in flight, so each urgent one starts at its LR; those still held at the iteration's end go
    then, by deadline (the WR that needs them in the next iteration)."""
    sched = build_schedule("fold", 2, 4, 4, "per-chunk", defer_reduce=True)
    sim = run_schedule(sched, _Deadlines(1.0, 2.0, t_reduce=10.0), iterations=3)
    for r in sim.ranks:
        deferred = set(sched.deferred_chunks(r.p))
        assert deferred and deferred != set(range(r.p, sched.segments, sched.pp))  # some chunks of each kind
        ev = [e for e in r.events if e["step"] == 1]
        launches = {e["args"]["chunk"]: e["start"] for e in ev if e["kind"] == "reduce_launch"}
        urgent = [e for e in ev if e["kind"] == "reduce" and not e["args"].get("deferred")]
        buckets = [e for e in ev if e["kind"] == "reduce" and e["args"].get("deferred")]
        assert {e["args"]["chunk"] for e in urgent} == set(launches) - deferred
        assert {e["args"]["chunk"] for e in buckets} == deferred and len(buckets) == 3 * len(deferred)
        end = max(e["end"] for e in ev if e["kind"] == "step")
        for u in urgent:
            assert u["start"] == approx(launches[u["args"]["chunk"]])  # never queued behind a deferred bucket
            held = [b for b in buckets if b["start"] < end - 1e-9]
            assert not [b for b in held if u["start"] - 1e-9 <= b["start"] < u["end"] - 1e-9], (u, held)
        late = sorted((b for b in buckets if b["start"] > end + 1e-9), key=lambda b: b["start"])
        assert len({b["args"]["chunk"] for b in late}) >= 2  # the backlog of two chunks was still held at the end
        order = [r.rules.deadline[b["args"]["chunk"]] for b in late]
        assert order == sorted(order)  # released at the end in deadline order


class _TwoFlows(UnitCosts):
    def send(self, p, a):
        return ("nic", 0), 1.0, 0.0, 100.0

    def link_bw(self, key):
        return 100.0  # bytes/s: one transfer alone takes 1 s


def test_shared_link_halves_bandwidth():
    sim = Sim(build_schedule("1f1b", 2, 1, 1), _TwoFlows(0.0, 0.0))
    got = []
    link = sim.link(("nic", 0))
    sim.at(0.0, lambda: link.add(100.0, 1.0, got.append))
    sim.at(0.0, lambda: link.add(100.0, 1.0, got.append))
    sim.at(0.0, lambda: link.add(50.0, 2.0, got.append))  # weight 2: two identical transfers of other ranks
    while sim._heap:
        import heapq

        t, _, fn = heapq.heappop(sim._heap)
        sim.now = t
        fn()
    # 4 unit flows share 100 B/s: the 50-byte pair ends at 2 s; the two 100-byte ones then have 50 B each at 50 B/s
    assert sorted(got) == approx([2.0, 3.0, 3.0])


class _SharedCores(UnitCosts):
    def __init__(self, t_f, t_b, cores, weight, over=1.0):
        super().__init__(t_f, t_b)
        self.share = (cores, 1.0, weight, over)

    def cpu_share(self):
        return self.share


@pytest.mark.parametrize("cores,weight", [(2.0, 1.0), (2.0, 2.0), (2.0, 4.0), (1.0, 2.0)])
def test_shared_cores_slow_only_what_runs_at_once(cores, weight):
    """Ranks sharing a host's cores (an emulated cluster): 2 pipeline ranks of ``weight`` identical
    ranks each. GPipe with 1 micro-batch never computes on both pipeline ranks at once, so each
    action runs at min(1, cores / weight) of a core; fold with 4 micro-batches overlaps the ranks."""
    t_f, t_b = 1.0, 2.0
    slow = max(1.0, weight / cores)
    one = run_schedule(build_schedule("gpipe", 2, 1, 1), _SharedCores(t_f, t_b, cores, weight))
    assert one.iter_end[0] == approx(2 * (t_f + t_b) * slow)
    alone = run_schedule(build_schedule("fold", 2, 2, 4), UnitCosts(t_f, t_b)).iter_end[0]
    shared = run_schedule(build_schedule("fold", 2, 2, 4), _SharedCores(t_f, t_b, cores, weight)).iter_end[0]
    work = 2 * 2 * 4 * (t_f + t_b) * weight  # core-seconds of every rank
    assert shared >= max(alone * slow, work / cores) - 1e-9
    assert shared <= alone * max(1.0, 2 * weight / cores) + 1e-9


@pytest.mark.parametrize("weight,slow", [(2.0, 1.0), (3.0, 2.0), (4.0, 4.0), (8.0, 8.0)])
def test_oversubscribed_cores_lose_work(weight, slow):
    """With ``node.oversubscribed_efficiency`` 0.5, 2 cores do 2 cores' work up to 2 busy ranks, 1.5 at
    3 (linearly), 1 from 4 on: a lone busy pipeline rank standing for ``weight`` ranks runs ``slow``
    times slower than on a core of its own (fair sharing alone: ``weight / 2``)."""
    t_f, t_b = 1.0, 2.0
    one = run_schedule(build_schedule("gpipe", 2, 1, 1), _SharedCores(t_f, t_b, 2.0, weight, over=0.5))
    assert one.iter_end[0] == approx(2 * (t_f + t_b) * slow)


class _Buckets(UnitCosts):
    """One rank, F = 1, B = 2; a reduction of two buckets of 0.5 s each: the first ready halfway
    through the backward (``cpu``: core-seconds its communication threads take meanwhile), the last
    at the ``LR``."""

    def __init__(self, cpu=0.0, cores=None, slowdown=0.0):
        super().__init__(1.0, 2.0)
        self.cpu, self.share, self.slowdown = cpu, (cores, 1.0, 1.0, 1.0) if cores else None, slowdown

    def overlap_slowdown(self):
        return self.slowdown

    def reduce_buckets(self, p, c):
        return [(0.5, [("delay", 0.5, self.cpu)]), (None, [("delay", 0.5)])]

    def cpu_share(self):
        return self.share


def test_buckets_launch_during_the_last_backward():
    """A data-parallel engine's bucket goes on the reduction stream when its gradients are complete,
    during the backward (F 0-1, B 1-3: the first bucket 2-2.5, the last 3-3.5), not at the ``LR``."""
    sched = build_schedule("1f1b", 1, 1, 1)
    sim = run_schedule(sched, _Buckets())
    assert sim.iter_end[0] == approx(3.5)  # both at the LR: 4.0
    red = [(e["start"], e["end"]) for e in sim.ranks[0].events if e["kind"] == "reduce" and e["step"] == 0]
    assert red == [approx((2.0, 2.5)), approx((3.0, 3.5))]  # both on the timeline
    assert run_schedule(sched, UnitCosts(1.0, 2.0, t_reduce=1.0)).iter_end[0] == approx(4.0)


def test_a_collectives_cpu_slows_the_backward_it_overlaps():
    """On one shared core, the first bucket's collective takes 1 core-second while the last half of the
    backward (1 s of work) runs: both at half speed, done at 4; then the last bucket 4-4.5. Without
    shared cores the CPU figure is ignored."""
    sched = build_schedule("1f1b", 1, 1, 1)
    sim = run_schedule(sched, _Buckets(cpu=1.0, cores=1.0))
    (b,) = [e for e in sim.ranks[0].events if e["kind"] == "compute" and e["args"]["op"] == "B" and e["step"] == 0]
    assert (b["start"], b["end"]) == (approx(1.0), approx(4.0))
    assert sim.iter_end[0] == approx(4.5)
    assert run_schedule(sched, _Buckets(cpu=1.0)).iter_end[0] == approx(3.5)


def test_a_collective_slows_the_device_compute_beside_it():
    """On an own device with ``overlap_slowdown`` 1, the backward runs at half speed while the first bucket
    (2-2.5) is in flight: 0.25 s of its work done then, the last 0.75 s after, so it ends at 3.25 and the
    last bucket runs 3.25-3.75. With shared cores the device figure is not used (the cores model it)."""
    sched = build_schedule("1f1b", 1, 1, 1)
    sim = run_schedule(sched, _Buckets(slowdown=1.0))
    (b,) = [e for e in sim.ranks[0].events if e["kind"] == "compute" and e["args"]["op"] == "B" and e["step"] == 0]
    assert (b["start"], b["end"]) == (approx(1.0), approx(3.25))
    assert sim.iter_end[0] == approx(3.75)
    assert run_schedule(sched, _Buckets(cores=1.0, slowdown=1.0)).iter_end[0] == approx(3.5)


class _Queued(UnitCosts):
    """Deferred chunks reduce in one bucket across node 0's interface (100 B/s; 1,500 bytes: still in flight when the
    iteration ends); the loss meeting takes 0.01 s, and its small collective waits behind at most ``cap`` seconds of
    the bytes queued on the interface."""

    def __init__(self, cap: float, nbytes: float = 1500.0):
        super().__init__(1.0, 2.0, t_reduce=3.0)
        self.cap, self.nbytes = cap, nbytes

    def deferred_buckets(self, p, c):
        return [[("flow", ("nic", 0), 1.0, self.nbytes)]]

    def link_bw(self, key):
        return 100.0

    def end_of_iteration(self):
        return 0.01

    def queue_cap(self, meeting):
        return self.cap


def _loss_wait(sim, it: int) -> float:
    """Iteration ``it``'s loss meeting beyond its last rank's arrival."""
    last = max(e["end"] for r in sim.ranks for e in r.events if e["kind"] == "step" and e["step"] == it)
    return sim.iter_end[it] - last


def test_small_collectives_wait_behind_the_bulk_bytes_queued_ahead():
    """A meeting's small collective (the loss all-reduce) waits behind the bytes in flight on the nodes' interfaces,
    at most ``queue_cap``: a FIFO (tc tbf on the emulated cluster) that bulk TCP keeps full. With no FIFO (cap 0),
    or nothing in flight, it waits only its own latency; the deferred buckets held go right after it."""
    sched = build_schedule("fold", 2, 2, 4, "per-chunk", defer_reduce=True)
    run = lambda cap, nbytes=1500.0: run_schedule(sched, _Queued(cap, nbytes), iterations=3)  # noqa: E731
    assert _loss_wait(run(0.0), 1) == approx(0.01)
    fifo = run(0.5)
    assert _loss_wait(fifo, 1) == approx(0.01 + 0.5)  # a deferred bucket in flight: the whole cap
    deep = run(100.0)  # a queue deeper than what is left: the meeting ends once the buckets in flight have crossed
    last = max(e["end"] for r in deep.ranks for e in r.events if e["kind"] == "step" and e["step"] == 1)
    ahead = [e["end"] for r in deep.ranks for e in r.events if e["kind"] == "reduce" and e["start"] < last < e["end"]]
    assert len(ahead) == 2 and deep.iter_end[1] == approx(max(ahead) + 0.01)
    assert _loss_wait(run(0.5, nbytes=1e-3), 1) == approx(0.01)  # nothing in flight
    for r in fifo.ranks:  # the next iteration starts at the meeting's end
        assert min(e["start"] for e in r.events if e["kind"] == "step" and e["step"] == 2) == approx(fifo.iter_end[1])
    # where the bytes would not arrive before the chunk's next forward anyway, the wait costs the period nothing
    period = lambda s: s.iter_end[2] - s.iter_end[1]  # noqa: E731
    assert period(fifo) == approx(period(run(0.0)))


class _Gathers(UnitCosts):
    """The distributed optimizer's all-gather of each chunk's weights: 2 s on the reduction stream."""

    def gather(self, p, c, without_tied=False):
        return [("delay", 2.0)]


def test_the_first_chunks_all_gather_goes_first():
    """rules.gather_order: fold steps the last chunk first, yet the all-gathers go on the reduction stream (a FIFO,
    as the dp group's collectives) in the order of the next forwards, so the first forward of the next iteration
    waits for its own chunk's all-gather alone (2 s after its step), not for those of the chunks stepped before it
    (8 s), which run beside the forwards before theirs."""
    sched = build_schedule("fold", 2, 4, 4, "per-chunk")
    sim = run_schedule(sched, _Gathers(1.0, 2.0, t_reduce=1.0, t_optim=0.5), iterations=2)
    ev = sim.ranks[0].events
    step = next(e["end"] for e in ev if e["step"] == 0 and e["kind"] == "optim" and e["args"]["chunk"] == 0)
    assert step == max(e["end"] for e in ev if e["step"] == 0 and e["kind"] == "optim")  # chunk 0 steps last
    waits = [e for e in ev if e["step"] == 1 and e["name"].startswith("AG")]
    assert [(e["name"], e["end"]) for e in waits] == [("AG c0", approx(step + 2.0))]
