"""Discrete-event engine: runs every action of every pipeline rank of a :class:`Schedule`.

The executor's semantics (``foldtrain/pipeline/executor.py``), action by action, per rank:

* ``F`` / ``B`` occupy the rank's compute stream for ``costs.compute``; on a cluster whose ranks
  share a host's CPU cores (``costs.cpu_share()`` is not ``None``: an emulated cluster on one
  machine) a compute action is instead ``costs.compute`` core-seconds of work on the shared
  ``("cpu",)`` resource, where each busy rank gets ``min(1, cores / busy ranks)`` of a core, less
  ``node.oversubscribed_efficiency`` when more ranks than cores are busy (the optimizer step too), and a reduction's transfer also needs ``costs.comm_cpu`` core-seconds there
  (gloo's threads sending, receiving and summing), so communication slows compute down as on the host;
* ``SA`` / ``SG`` post a transfer (never block); it starts after the link's latency; on a
  dedicated link between two ranks of a node transfers go one after another in posting order
  (one stream per pair), on a node's network interface they share it with the transfers in
  flight there;
* ``RA`` / ``RG`` block until the matching transfer has arrived (``recv_wait``);
* ``LR(c)`` queues chunk ``c``'s data-parallel reduction on the rank's reduction stream (FIFO; a
  collective with identical data-parallel peers, so it needs no other simulated rank); for the
  first and last segment the tied embedding's dp part goes on that stream first, and once it is
  done the end sends the other what it lacks on a second stream (``costs.tie``: ``{"dp": phases,
  "send": phases}``); an end's tied copy is done when its dp part and the other's send are; a reduction is a list
  of collectives (``costs.reduce_buckets``: ``(ready, phases)``), and those with a ``ready`` fraction
  go on the stream when that fraction of the ``B`` just before the ``LR`` is done (a data-parallel
  engine's buckets, launched while the last backward still runs), the rest at the ``LR``;
* a deferred chunk's ``LR`` (``--fold.defer_reduce``) puts its buckets (``costs.deferred_buckets``) in
  the rank's deadline queue instead (``parallel/pipeline/deadlines.py``): they go on a second stream
  one at a time, only while nothing is on the first (urgent reductions never wait behind them), and
  whatever is still held when the rank leaves the iteration's end barrier goes at once, sorted by
  deadline (the position of the ``WR`` that needs it); with clipping (``costs.hold_deferred()``
  false) nothing is held;
* ``WR(c)`` blocks until both are done (``reduce_wait``); a deferred ``WR`` (before the chunk's
  first forward) waits for the reduction launched in the previous iteration and is skipped in
  the first one;
* ``OS(c)`` takes ``costs.optim``; before the first non-deferred ``OS`` of an iteration the
  ranks meet in ``costs.before_steps`` (gradient-norm all-reduce over the pipeline, fp16
  overflow vote): a barrier of the pipeline;
* after its last action a rank waits for its sends to complete (the executor's end-of-iteration
  wait), ends the step, and meets the others in ``costs.end_of_iteration`` (the loss all-reduce).

Links are shared fluidly: the ``k`` transfers in flight on a link each get ``bw / W`` where ``W``
sums their weights (a weight ``w`` stands for ``w`` identical transfers of symmetric ranks that
are not simulated). The result is a list of per-rank events in the format of
:mod:`foldtrain.profile.timeline`, so :func:`foldtrain.profile.summarize` and the Gantt / trace
exporters read simulated and measured runs alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from foldtrain.schedules import Op, Schedule, message_key

Phase = tuple  # ("delay", seconds[, core-seconds on the shared cores meanwhile]) | ("flow", link_key, weight, nbytes)
CPU = ("cpu",)  # the host's cores, when the ranks share them


class SharedLink:
    """A link of bandwidth ``bw`` bytes/s shared by the flows in flight (weighted processor sharing);
    one unit of weight never gets more than ``cap`` (a rank cannot use more than one core). ``over``
    (the host's cores): the share of ``bw`` left when the flows' weights sum to twice ``bw`` or more,
    linearly from 1 at ``bw`` (more runnable threads than cores switch and evict each other's caches)."""

    __slots__ = ("sim", "bw", "cap", "over", "flows", "t", "ver", "_next")

    def __init__(self, sim: Sim, bw: float, cap: float = float("inf"), over: float = 1.0):
        self.sim, self.bw, self.cap, self.over = sim, bw, cap, over
        self.flows: dict[int, list] = {}
        self.t = 0.0
        self.ver = 0
        self._next = 0

    def rate(self) -> float:
        w = sum(f[1] for f in self.flows.values())
        bw = self.bw
        if self.over < 1.0 and w > bw:
            bw *= 1.0 - (1.0 - self.over) * min(1.0, (w - bw) / bw)
        return min(self.cap, bw / w)

    def _advance(self, now: float) -> None:
        if self.flows and now > self.t:
            rate = self.rate()
            dt = now - self.t
            for f in self.flows.values():
                f[0] -= rate * dt
        self.t = now

    def add(self, nbytes: float, weight: float, done: Callable[[float], None]) -> None:
        now = self.sim.now
        if nbytes <= 0:
            done(now)
            return
        self._advance(now)
        self._next += 1
        self.flows[self._next] = [nbytes, weight, done]
        self._reschedule(now)

    def _reschedule(self, now: float) -> None:
        self.ver += 1
        if not self.flows:
            return
        rate = self.rate()
        rem = min(f[0] for f in self.flows.values())
        ver = self.ver
        self.sim.at(now + max(rem, 0.0) / rate, lambda: self._complete(ver))

    def _complete(self, ver: int) -> None:
        if ver != self.ver:
            return
        now = self.sim.now
        self._advance(now)
        rate = self.rate()
        eps = max(1e-6, rate * (abs(now) * 1e-12 + 1e-15))  # below the clock's resolution
        done = [k for k, f in self.flows.items() if f[0] <= eps]
        cbs = [self.flows.pop(k)[2] for k in done]
        self._reschedule(now)
        for cb in cbs:
            cb(now)


class Stream:
    """A FIFO of phase lists (a rank's reduction stream): one job at a time; ``after()`` once each is done."""

    def __init__(self, sim: Sim, after: Callable[[], None] | None = None):
        self.sim = sim
        self.queue: list = []
        self.busy = False
        self.after = after

    def submit(self, ready_at: float, phases: list[Phase], done: Callable[[float, float], None]) -> None:
        self.queue.append((ready_at, phases, done))
        if not self.busy:
            self._start_next()

    def _start_next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        ready_at, phases, done = self.queue.pop(0)
        start = max(ready_at, self.sim.now)

        def finish(t: float) -> None:
            done(start, t)
            self._start_next()
            if self.after is not None:
                self.after()

        self.sim.at(start, lambda: self.sim.run_phases(list(phases), finish))


@dataclass
class RankState:
    p: int
    pc: int = 0
    it: int = 0
    t: float = 0.0  # time the rank reached its current action
    stepped: bool = False
    in_flight: int = 0  # sends posted this iteration and not delivered
    last_send: float = 0.0  # latest delivery of this iteration's sends
    waiting_sends: bool = False
    events: list = field(default_factory=list)
    step_start: float = 0.0
    deferred: set = field(default_factory=set)
    debt: float = 0.0  # the executor's own host work for the actions since the last compute, not yet paid


class Sim:
    """The event loop and the pipeline ranks' interpreters."""

    def __init__(self, sched: Schedule, costs: Any, iterations: int = 2, record_from: int = 0):
        self.sched, self.costs, self.iterations = sched, costs, iterations
        self.record_from = record_from
        share = getattr(costs, "cpu_share", lambda: None)()
        self.cpu = share  # (cores, per-rank cap, weight of a simulated rank, oversubscribed efficiency) or None
        self.overhead = getattr(costs, "action_overhead", lambda: 0.0)()  # the executor's host work per action
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.links: dict[tuple, SharedLink] = {}
        self.fifo: dict[tuple, float] = {}  # dedicated FIFO links: when they are free
        P = sched.pp
        self.ranks = [RankState(p, deferred=set(sched.deferred_chunks(p))) for p in range(P)]
        self.dp_stream = [Stream(self, after=lambda p=p: self.pump(p)) for p in range(P)]
        # --fold.defer_reduce: the deadline queue (parallel/pipeline/deadlines.py). Deferred buckets go on a
        # second stream (group), one at a time and only while no urgent reduction is in flight, until the
        # iteration's end, when the rest go at once in deadline order (the WR that needs them)
        self.defer_stream = [Stream(self, after=lambda p=p: self.pump(p)) for p in range(P)]
        self.pending: list[list] = [[] for _ in range(P)]  # (deadline, chunk, bucket, phases, done), in launch order
        self.hold = getattr(costs, "hold_deferred", lambda: True)()
        self.deadline = [{a.chunk: i for i, a in enumerate(acts) if a.op is Op.WAIT_REDUCE} for acts in sched.ranks]
        self.tie_stream = [Stream(self) for _ in range(P)]
        self.arrived: dict[tuple, float] = {}  # (iteration, message key) -> arrival time
        self.recv_waiters: dict[tuple, Callable[[float], None]] = {}
        self.red_done: dict[tuple, float] = {}  # (p, chunk, iteration, "dp"|"tie") -> completion
        self.red_waiters: dict[tuple, list] = {}
        self.tie_launch: dict[tuple, float] = {}  # (iteration, side) -> its dp part done
        self.tie_recv: dict[tuple, float] = {}  # (iteration, side) -> the other end's send arrived
        self.barriers: dict[tuple, list] = {}
        self.iter_end: list[float] = []  # per iteration: when every rank left its end barrier
        self._ended: dict[int, list] = {}

    # ---------------------------------------------------------------- loop
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def link(self, key: tuple) -> SharedLink:
        ln = self.links.get(key)
        if ln is None:
            if key == CPU:
                cores, cap, _, over = self.cpu
                ln = self.links[key] = SharedLink(self, cores, cap, over)
            else:
                ln = self.links[key] = SharedLink(self, self.costs.link_bw(key))
        return ln

    def busy(self, r: RankState, dur: float, done: Callable[[float], None], start: float | None = None) -> None:
        """``dur`` seconds of this rank's compute from ``start`` (default ``r.t``): on the shared cores if
        there are any, else alone."""
        start = r.t if start is None else start
        if self.cpu is None:
            done(start + dur)  # its own device: the end is known now (``done`` resumes the rank then)
        else:
            self.at(start, lambda: self.link(CPU).add(dur, self.cpu[2], done))

    def busy_marked(
        self, r: RankState, start: float, dur: float, marks: list, done: Callable[[float], None], reached: float = 0.0
    ) -> None:
        """``busy`` in pieces: ``marks[i][1](t)`` is called when fraction ``marks[i][0]`` of ``dur`` is done
        (``reached``: the fraction done before ``start``)."""
        if not marks:
            self.busy(r, dur * (1.0 - reached), done, start)
            return
        (f, cb), rest = marks[0], marks[1:]
        f = min(max(f, reached), 1.0)

        def at_mark(t: float) -> None:
            cb(t)
            self.busy_marked(r, t, dur, rest, done, f)

        self.busy(r, dur * (f - reached), at_mark, start)

    def bucket_done(self, r: RankState, c: int, k: int) -> Callable[[float, float], None]:
        """Records bucket ``k`` of chunk ``c``'s reduction, launched during the backward, on ``r``'s timeline."""
        it = r.it

        def done(start: float, t: float) -> None:
            if it >= self.record_from:
                r.events.append(
                    {
                        "name": f"reduce c{c} b{k}",
                        "kind": "reduce",
                        "rank": r.p,
                        "start": start,
                        "end": t,
                        "step": it,
                        "args": {"chunk": c, "bucket": k},
                    }
                )

        return done

    def buckets(self, p: int, c: int) -> list:
        fn = getattr(self.costs, "reduce_buckets", None)
        return fn(p, c) if fn is not None else [(None, self.costs.reduce_phases(p, c))]

    def run_phases(self, phases: list[Phase], done: Callable[[float], None]) -> None:
        if not phases:
            done(self.now)
            return
        ph = phases.pop(0)
        nxt = lambda t: self.run_phases(phases, done)  # noqa: E731
        if ph[0] == "delay":
            cpu_s = ph[2] if len(ph) > 2 else 0.0
            start = lambda cb: self.at(self.now + ph[1], lambda: cb(self.now))  # noqa: E731
        else:
            _, key, weight, nbytes = ph
            cpu_s = self.costs.comm_cpu(nbytes) if hasattr(self.costs, "comm_cpu") else 0.0
            start = lambda cb: self.link(key).add(nbytes, weight, cb)  # noqa: E731
        if self.cpu is None or cpu_s <= 0:
            start(nxt)
            return
        left = [2]  # the wait or transfer, and its communication threads' work on the shared cores: done when both are

        def part(t: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                nxt(t)

        start(part)
        self.link(CPU).add(cpu_s, self.cpu[2], part)

    def run(self) -> Sim:
        for r in self.ranks:
            self.at(0.0, lambda r=r: self.step(r))
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()
        stuck = [r.p for r in self.ranks if r.it < self.iterations]
        if stuck:
            r = self.ranks[stuck[0]]
            raise RuntimeError(f"simulation stalled: rank {r.p} at action #{r.pc} of iteration {r.it}")
        return self

    # ---------------------------------------------------------------- recording
    def ev(self, r: RankState, name: str, kind: str, s: float, e: float, **args) -> None:
        if r.it >= self.record_from:
            r.events.append({"name": name, "kind": kind, "rank": r.p, "start": s, "end": e, "step": r.it, "args": args})

    # ---------------------------------------------------------------- the interpreter
    def resume(self, r: RankState, t: float) -> None:
        r.t = max(r.t, t)
        self.at(max(r.t, self.now), lambda: self.step(r))

    def step(self, r: RankState) -> None:  # noqa: C901 - one branch per action kind
        acts = self.sched.ranks[r.p]
        costs = self.costs
        overhead = self.overhead
        while r.pc < len(acts):
            a = acts[r.pc]
            op = a.op
            if op is Op.FORWARD or op is Op.BACKWARD:
                t0 = r.t
                dur = costs.compute(r.p, a) + r.debt + overhead
                r.debt = 0.0

                def computed(t: float, r=r, a=a, t0=t0) -> None:
                    self.ev(
                        r, f"{a.op.value} c{a.chunk} m{a.mb}", "compute", t0, t, op=a.op.value, chunk=a.chunk, mb=a.mb
                    )
                    r.pc += 1
                    self.resume(r, t)

                nxt = acts[r.pc + 1] if r.pc + 1 < len(acts) else None
                if op is Op.BACKWARD and nxt is not None and nxt.op is Op.LAUNCH_REDUCE and nxt.chunk == a.chunk:
                    early = [(f, ph) for f, ph in self.buckets(r.p, a.chunk) if f is not None]
                    if early:  # buckets launched during this backward as their gradients complete
                        marks = [
                            (
                                f,
                                lambda t, ph=ph, r=r, a=a, k=k: self.dp_stream[r.p].submit(
                                    t, list(ph), self.bucket_done(r, a.chunk, k)
                                ),
                            )
                            for k, (f, ph) in enumerate(early)
                        ]
                        self.busy_marked(r, r.t, dur, marks, computed)
                        return
                self.busy(r, dur, computed)
                return
            if op is Op.SEND_ACT or op is Op.SEND_GRAD:
                r.debt += overhead
                key, weight, lat, nbytes = costs.send(r.p, a)
                r.in_flight += 1
                msg = (r.it, message_key(a))
                self.ev(
                    r,
                    f"{op.value} c{a.chunk} m{a.mb}",
                    "send",
                    r.t,
                    r.t,
                    chunk=a.chunk,
                    mb=a.mb,
                    peer=a.peer,
                    instant=True,
                )

                def delivered(t: float, r=r, msg=msg) -> None:
                    r.in_flight -= 1
                    r.last_send = max(r.last_send, t)
                    self.arrived[msg] = t
                    w = self.recv_waiters.pop(msg, None)
                    if w:
                        w(t)
                    if r.waiting_sends and r.in_flight == 0:
                        r.waiting_sends = False
                        self.at(self.now, lambda: self.step(r))

                if key[0] == "p2p":  # a dedicated pair link: one stream, transfers in posting order (NCCL)
                    start = max(r.t + lat, self.fifo.get(key, 0.0))
                    t_done = start + nbytes / self.costs.link_bw(key)
                    self.fifo[key] = t_done
                    self.at(t_done, lambda t_done=t_done, delivered=delivered: delivered(t_done))
                else:
                    self.at(r.t, lambda: self.run_phases([("delay", lat), ("flow", key, weight, nbytes)], delivered))
                r.pc += 1
                continue
            if op is Op.RECV_ACT or op is Op.RECV_GRAD:
                msg = (r.it, message_key(a))
                t_arr = self.arrived.get(msg)
                if t_arr is not None and t_arr <= r.t:
                    r.debt += overhead
                    r.pc += 1
                    continue
                if t_arr is None:
                    t0 = r.t

                    def got(t: float, r=r, a=a, t0=t0) -> None:
                        r.debt += overhead
                        if t > t0:
                            self.ev(
                                r,
                                f"{a.op.value} c{a.chunk} m{a.mb}",
                                "recv_wait",
                                t0,
                                t,
                                chunk=a.chunk,
                                mb=a.mb,
                                peer=a.peer,
                            )
                        r.pc += 1
                        self.resume(r, t)

                    self.recv_waiters[msg] = got
                    return
                self.ev(
                    r, f"{op.value} c{a.chunk} m{a.mb}", "recv_wait", r.t, t_arr, chunk=a.chunk, mb=a.mb, peer=a.peer
                )
                r.debt += overhead
                r.pc += 1
                self.resume(r, t_arr)
                return
            if op is Op.LAUNCH_REDUCE:
                r.debt += overhead
                self.launch_reduce(r, a.chunk)
                r.pc += 1
                continue
            if op is Op.WAIT_REDUCE:
                it = r.it - 1 if a.chunk in r.deferred else r.it
                if it < 0:
                    r.pc += 1
                    continue
                need = [(r.p, a.chunk, it, "dp")]
                if self.costs.tie(r.p, a.chunk) is not None:
                    need.append((r.p, a.chunk, it, "tie"))
                missing = [k for k in need if k not in self.red_done]
                if missing:
                    # re-check once it is done (the rank's clock stays where it blocked)
                    self.red_waiters.setdefault(missing[0], []).append(
                        lambda t, r=r: self.at(self.now, lambda: self.step(r))
                    )
                    return
                t_done = max(self.red_done[k] for k in need)
                r.debt += overhead
                if t_done > r.t:
                    self.ev(
                        r, f"WR c{a.chunk}", "reduce_wait", r.t, t_done, chunk=a.chunk, deferred=a.chunk in r.deferred
                    )
                    r.pc += 1
                    self.resume(r, t_done)
                    return
                r.pc += 1
                continue
            if op is Op.OPTIM_STEP:
                if a.chunk in r.deferred:
                    if r.it == 0:
                        r.pc += 1
                        continue
                elif not r.stepped:
                    cost = costs.before_steps()
                    if cost is not None:
                        if not self.barrier(r, ("clip", r.it), cost, "clip", "optim"):
                            return
                    r.stepped = True
                dur = costs.optim(r.p, a.chunk) + r.debt + overhead
                r.debt = 0.0
                r.pc += 1
                if dur > 0:
                    t0 = r.t

                    def stepped(t: float, r=r, a=a, t0=t0) -> None:
                        self.ev(r, f"OS c{a.chunk}", "optim", t0, t, chunk=a.chunk, deferred=a.chunk in r.deferred)
                        self.resume(r, t)

                    self.busy(r, dur, stepped)
                    return
                continue
            raise ValueError(f"unknown action {a}")
        # end of the iteration: pay the executor's remaining host work, wait for this rank's sends, end the
        # step, meet in the loss all-reduce
        if r.debt > 0:
            debt, r.debt = r.debt, 0.0
            self.busy(r, debt, lambda t, r=r: self.resume(r, t))
            return
        if r.in_flight:
            r.waiting_sends = True
            return
        t_sent = r.last_send
        if t_sent > r.t:
            self.ev(r, "send wait", "send", r.t, t_sent)
            r.t = t_sent
        if not getattr(r, "_step_closed", False):
            self.ev(r, f"step {r.it}", "step", r.step_start, r.t)
            r._step_closed = True  # type: ignore[attr-defined]
        cost = costs.end_of_iteration()
        if cost is not None and not self.barrier(r, ("loss", r.it), cost, None, None):
            return
        self.iter_end_mark(r)

    def iter_end_mark(self, r: RankState) -> None:
        ends = self._ended.setdefault(r.it, [])
        ends.append(r.t)
        if len(ends) == len(self.ranks):
            self.iter_end.append(max(ends))
        self.release_deferred(r.p, r.t)
        r.it += 1
        r.pc = 0
        r.last_send = 0.0
        r.stepped = False
        r._step_closed = False  # type: ignore[attr-defined]
        r.step_start = r.t
        if r.it < self.iterations:
            self.resume(r, r.t)

    def barrier(self, r: RankState, key: tuple, cost: float, name: str | None, kind: str | None) -> bool:
        """True when every rank has arrived (and ``r.t`` is past the collective); else park ``r``."""
        b = self.barriers.setdefault(key, [None, []])
        if b[0] is not None:  # released
            t_rel = b[0]
            if name and t_rel > b[2][r.p]:
                self.ev(r, name, kind, b[2][r.p], t_rel)
            r.t = max(r.t, t_rel)
            return True
        if len(b) == 2:
            b.append({})
        b[2][r.p] = r.t
        b[1].append(r)
        if len(b[1]) < len(self.ranks):
            return False
        t_rel = max(b[2].values()) + cost
        b[0] = t_rel
        for q in b[1]:
            self.at(t_rel, lambda q=q: self.step(q))
        return False

    # ---------------------------------------------------------------- reductions
    def launch_reduce(self, r: RankState, c: int) -> None:
        it = r.it
        self.ev(r, f"LR c{c}", "reduce_launch", r.t, r.t, chunk=c, instant=True)

        def done(kind: str, start: float, t: float, r=r, record: bool = True) -> None:
            if kind == "dp" and record and it >= self.record_from:
                r.events.append(
                    {
                        "name": f"reduce c{c}",
                        "kind": "reduce",
                        "rank": r.p,
                        "start": start,
                        "end": t,
                        "step": it,
                        "args": {"chunk": c},
                    }
                )
            key = (r.p, c, it, kind)
            self.red_done[key] = t
            for w in self.red_waiters.pop(key, []):
                w(t)

        tie = self.costs.tie(r.p, c)
        if tie is not None:  # its dp part goes first on the stream, the pair's sum once both ends' are done
            side = 0 if c == 0 else 1
            self.dp_stream[r.p].submit(r.t, list(tie["dp"]), lambda s, t, side=side: self._tie_dp_done(it, side, t))
        deferred = getattr(self.costs, "deferred_buckets", lambda p, c: None)(r.p, c) if c in r.deferred else None
        if deferred:
            self.queue_deferred(r, c, deferred, done)
            return
        at_lr = [ph for f, phases in self.buckets(r.p, c) if f is None for ph in phases]  # the others went during the B
        self.dp_stream[r.p].submit(r.t, at_lr, lambda s, t: done("dp", s, t))

    def queue_deferred(self, r: RankState, c: int, buckets: list, done: Callable) -> None:
        """Chunk ``c``'s deferred buckets into the deadline queue; ``done("dp", start, end)`` after the last."""
        it, left, first = r.it, [len(buckets)], [None]

        def bucket_done(start: float, t: float, k: int) -> None:
            if it >= self.record_from:
                r.events.append(
                    {
                        "name": f"reduce c{c} b{k}",
                        "kind": "reduce",
                        "rank": r.p,
                        "start": start,
                        "end": t,
                        "step": it,
                        "args": {"chunk": c, "bucket": k, "deferred": True},
                    }
                )
            first[0] = start if first[0] is None else first[0]
            left[0] -= 1
            if left[0] == 0:
                done("dp", first[0], t, record=False)  # the buckets are its events

        deadline = self.deadline[r.p].get(c, len(self.sched.ranks[r.p]))
        for k, phases in enumerate(buckets):
            self.pending[r.p].append((deadline, c, k, list(phases), lambda s, t, k=k: bucket_done(s, t, k)))
        self.pump(r.p)

    def pump(self, p: int) -> None:
        """Issue rank ``p``'s next deferred bucket if no urgent reduction and no deferred bucket is in flight
        (all of them at once with clipping: nothing is held back then)."""
        q = self.pending[p]
        if not q:
            return
        if not self.hold:
            self.release_deferred(p, self.now, sort=False)
        elif not self.dp_stream[p].busy and not self.defer_stream[p].busy:
            job = q.pop(0)
            self.defer_stream[p].submit(self.now, job[3], job[4])

    def release_deferred(self, p: int, t: float, sort: bool = True) -> None:
        """Every deferred bucket of rank ``p`` still held, issued now (by deadline: the iteration's end)."""
        q = self.pending[p]
        if sort:
            q.sort(key=lambda j: j[:3])
        for job in q:
            self.defer_stream[p].submit(max(t, self.now), job[3], job[4])
        q.clear()

    def _tie_dp_done(self, it: int, side: int, t: float) -> None:
        """One end's dp part is done: it sends the other end what that one lacks (the head its dense
        copy, the embedding its rows); an end is done once its own dp part and the other's send are."""
        self.tie_launch[(it, side)] = t
        p, ch = self._tie_end(side)
        send = self.costs.tie(p, ch)["send"]
        self.tie_stream[p].submit(t, list(send), lambda s, t2, side=side: self._tie_arrived(it, 1 - side, t2))
        self._tie_arrived(it, side, None)

    def _tie_arrived(self, it: int, side: int, t: float | None) -> None:
        if t is not None:
            self.tie_recv[(it, side)] = t
        own, got = self.tie_launch.get((it, side)), self.tie_recv.get((it, side))
        if own is not None and got is not None:
            self._tie_done(*self._tie_end(side), it, max(own, got))

    def _tie_end(self, side: int) -> tuple[int, int]:
        """(pipeline rank, segment) of the tie's embedding end (side 0) or head end (side 1)."""
        return (0, 0) if side == 0 else (self.sched.pp - 1, self.sched.segments - 1)

    def _tie_done(self, p: int, c: int, it: int, t: float) -> None:
        key = (p, c, it, "tie")
        self.red_done[key] = t
        for w in self.red_waiters.pop(key, []):
            w(t)


def run_schedule(sched: Schedule, costs: Any, iterations: int = 2, record_from: int = 0) -> Sim:
    """Simulate ``iterations`` iterations of ``sched``; returns the finished :class:`Sim`."""
    return Sim(sched, costs, iterations, record_from).run()
