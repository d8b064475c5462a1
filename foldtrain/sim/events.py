"""Discrete-event engine: runs every action of every pipeline rank of a :class:`Schedule`.

It interprets the same action lists as the executor (:mod:`foldtrain.parallel.pipeline.executor`)
with the same runtime rules (:mod:`foldtrain.schedules.rules`: deadlines, what the first iteration
skips, where the iteration's global work runs, early steps, where the tie's reduction starts), one
handler per op, with the durations and bytes of a :class:`Costs`:

* ``F`` / ``B`` / ``I`` / ``W`` occupy the rank's compute stream for ``costs.compute``; on a cluster whose ranks
  share a host's CPU cores (``costs.cpu_share()`` is not ``None``: an emulated cluster on one
  machine) a compute action is instead ``costs.compute`` core-seconds of work on the shared
  ``("cpu",)`` resource, where each busy rank gets ``min(1, cores / busy ranks)`` of a core, less
  ``node.oversubscribed_efficiency`` when more ranks than cores are busy (the optimizer step too),
  and a reduction's transfer also needs ``costs.comm_cpu`` core-seconds there (gloo's threads
  sending, receiving and summing), so communication slows compute down as on the host; on own devices
  compute runs ``1 + costs.overlap_slowdown()`` times slower while any of the rank's reduction streams
  runs a collective (NCCL's kernels take SMs and memory bandwidth from it);
* before a compute action, the all-gathers it needs (``costs.unshard``: FSDP's units found sharded) run on the
  rank's reduction stream and the rank waits for them (``reduce_wait``); likewise before an ``LR`` what it
  waits for (``costs.blocking_reduce``: FSDP's reduce-scatters);
* ``SA`` / ``SG`` post a transfer (never block); it starts after the link's latency; on a
  dedicated link between two ranks of a node transfers go one after another in posting order
  (one stream per pair), on a node's network interface they share it with the transfers in
  flight there;
* ``RA`` / ``RG`` block until the matching transfer has arrived (``recv_wait``);
* ``LR(c)`` queues chunk ``c``'s data-parallel reduction on the rank's reduction stream (FIFO; a
  collective with identical data-parallel peers, so it needs no other simulated rank). A reduction
  is a list of collectives (``costs.reduce_buckets``: ``(ready, phases)``), and those with a
  ``ready`` fraction go on the stream when that fraction of the ``B`` (or ``W``) just before the ``LR`` is
  done (a data-parallel engine's buckets, launched while the last backward still runs), the rest
  at the ``LR``;
* the tied embedding's dp part (``costs.tie``: ``{"dp": phases, "send": phases}``) goes on that
  stream where the rules launch it (the last forward of the last segment with per-chunk sync, else
  the ``LR``, before the chunk's own reduction); once it is done the end sends the other what it
  lacks on a second stream; an end's tied copy is done when its dp part and the other's send are;
* a deferred chunk's ``LR`` (``--fold.defer_reduce``) puts its buckets (``costs.deferred_buckets``)
  in the rank's deadline queue instead (:mod:`foldtrain.parallel.pipeline.deadlines`): they go on a
  second stream one at a time, only while nothing is on the first (urgent reductions never wait
  behind them), and whatever is still held when the rank leaves the iteration's end barrier goes
  at once, sorted by deadline; when the :class:`StepPolicy` clips, nothing is held;
* ``WR(c)`` blocks until both are done (``reduce_wait``); a deferred ``WR`` waits for the reduction
  launched in the previous iteration and is skipped in the first one; with the policy's early
  steps a non-deferred chunk's optimizer step runs right after its ``WR``;
* ``OS(c)`` takes ``costs.optim``; at the first non-deferred ``OS`` of an iteration the ranks meet
  in ``costs.before_steps`` (gradient-norm all-reduce over the pipeline, fp16 overflow vote): a
  barrier of the pipeline (after this iteration's deferred reductions, when the policy clips);
* after its last action a rank waits for its sends to complete (the executor's end-of-iteration
  wait), ends the step, and meets the others in ``costs.end_of_iteration`` (the loss all-reduce).

Transfers share links fluidly (:mod:`.links`). The result is a list of per-rank events in the
format of :mod:`foldtrain.profile.timeline`, so :func:`foldtrain.profile.summarize` and the Gantt /
trace exporters read simulated and measured runs alike; ``RankState.launches`` lists, per rank, the
communication each iteration launches, in the order the executor's trace shows it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from foldtrain.schedules import (
    WEIGHT_OPS,
    Action,
    GatherRelease,
    Op,
    RankRules,
    Rule,
    Schedule,
    StepPolicy,
    message_key,
    rank_rules,
)

from .links import CPU, Phase, SharedLink, Stream


class Costs(Protocol):
    """What the engine asks of a cost model (``p``: pipeline rank, ``c``: global segment)."""

    def compute(self, p: int, a: Action) -> float:
        """Seconds (or core-seconds on shared cores) of an ``F``, ``B``, ``I`` or ``W``."""

    def send(self, p: int, a: Action) -> tuple[tuple, float, float, float]:
        """``(link key, weight, latency, bytes)`` of an ``SA`` / ``SG`` transfer."""

    def reduce_buckets(self, p: int, c: int) -> list[tuple[float | None, list[Phase]]]:
        """Chunk ``c``'s reduction: ``(ready fraction of the last B, or None: at the LR; phases)`` per collective."""

    def deferred_buckets(self, p: int, c: int) -> list[list[Phase]] | None:
        """A deferred chunk's reduction as the deadline queue's buckets, or ``None`` (one urgent reduction)."""

    def tie(self, p: int, c: int) -> dict | None:
        """The tied embedding's ``{"dp": phases, "send": phases}`` at the end holding ``c``, or ``None``."""

    def optim(self, p: int, c: int) -> float:
        """Seconds of chunk ``c``'s optimizer step."""

    def unshard(self, p: int, a: Action) -> list[Phase] | None:
        """All-gathers compute action ``a`` waits for on the rank's reduction stream (FSDP's), or ``None``."""

    def blocking_reduce(self, p: int, c: int) -> list[Phase] | None:
        """What chunk ``c``'s ``LR`` waits for on the reduction stream before its reduction (FSDP's
        reduce-scatters), or ``None``."""

    def gather(self, p: int, c: int, without_tied: bool = False) -> list[Phase] | None:
        """The all-gather of chunk ``c``'s weights its step starts (the distributed optimizer), on the rank's
        reduction stream, which the chunk's next forward waits for; ``None``: none. ``without_tied``: its tied
        copy's slice stepped apart (``early_tie``)."""

    def pair_gather(self, p: int, c: int) -> list[Phase] | None:
        """Where the two ends split the tied copy's state: the other end's stepped half, on the tie's stream after
        chunk ``c``'s step (or its tied half's, ``early_tie``), which the chunk's next forward waits for; else
        ``None``."""

    def tied_gather(self, p: int, c: int) -> list[Phase] | None:
        """The all-gather of chunk ``c``'s tied copy where it steps apart (``early_tie``: ``--optim.shard_tied``'s
        sliced copy, all of whose rows are read, or the half the other end stepped), or ``None``."""

    def tied_gather_queued(self, p: int, c: int) -> bool:
        """Whether :meth:`tied_gather` joins the deferred buckets by deadline, not the reduction stream at once."""

    def before_steps(self) -> float | None:
        """Seconds of the ranks' meeting before the first optimizer step, or ``None``: no meeting."""

    def end_of_iteration(self) -> float | None:
        """Seconds of the ranks' meeting after the iteration (the loss all-reduce), or ``None``."""

    def queue_cap(self, meeting: str) -> float:
        """The most a meeting's small collective waits behind the bytes queued on the nodes' interfaces."""

    def link_bw(self, key: tuple) -> float:
        """Bytes/s of a link."""

    def cpu_share(self) -> tuple[float, float, float, float] | None:
        """``(cores, per-rank cap, weight of a simulated rank, oversubscribed efficiency)`` when the
        ranks share a host's cores, else ``None``."""

    def comm_cpu(self, nbytes: float) -> float:
        """Core-seconds of the shared cores a collective moving ``nbytes`` takes."""

    def action_overhead(self) -> float:
        """The executor's own host work per action, in seconds."""

    def overlap_slowdown(self) -> float:
        """A device's compute takes ``1 +`` this as long while its reduction streams run a collective."""

    def policy(self) -> StepPolicy:
        """The run's step policy (early steps, clipping), as the engine derives it."""


@dataclass
class RankState:
    p: int
    rules: RankRules
    pc: int = 0
    it: int = 0
    t: float = 0.0  # time the rank reached its current action
    in_flight: int = 0  # sends posted this iteration and not delivered
    last_send: float = 0.0  # latest delivery of this iteration's sends
    waiting_sends: bool = False
    step_closed: bool = False  # this iteration's "step" event is recorded
    events: list = field(default_factory=list)
    launches: list = field(default_factory=list)  # (iteration, "SA c1 m0" | "RA .." | "LR c3" | "tie c3" | "clip")
    stepped_early: set = field(default_factory=set)  # chunks whose WR stepped them this iteration
    tied_apart: set = field(default_factory=set)  # chunks whose tied slice stepped at the last iteration's end
    gathers: GatherRelease | None = None  # this iteration's all-gather order (the rules' gather_order)
    step_start: float = 0.0
    debt: float = 0.0  # the executor's own host work for the actions since the last compute, not yet paid
    prepared: tuple = ()  # (iteration, pc) of the action whose waits (unshard, blocking reduce) are done

    def __post_init__(self) -> None:
        self.gathers = GatherRelease(self.rules.gather_order)

    @property
    def deferred(self) -> frozenset[int]:
        return self.rules.deferred


class Sim:
    """The event loop and the pipeline ranks' interpreters."""

    def __init__(self, sched: Schedule, costs: Costs, iterations: int = 2, record_from: int = 0):
        self.sched, self.costs, self.iterations = sched, costs, iterations
        self.record_from = record_from
        self.cpu = costs.cpu_share()  # (cores, per-rank cap, weight of a simulated rank, efficiency) or None
        self.overhead = costs.action_overhead()  # the executor's host work per action
        self.policy = costs.policy()
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.links: dict[tuple, SharedLink] = {}
        self.fifo: dict[tuple, float] = {}  # dedicated FIFO links: when they are free
        P = sched.pp
        self.ranks = [RankState(p, rank_rules(sched, p)) for p in range(P)]
        # own devices whose compute slows beside a collective: each rank's compute is a flow on its own
        # device, at 1 / (1 + slowdown) of its rate while any of its streams below is busy
        slowdown = costs.overlap_slowdown() if self.cpu is None else 0.0
        self.slowdown = slowdown
        self.device = [SharedLink(self, 1.0) for _ in range(P)] if slowdown > 0 else None
        self.in_flight = [0] * P
        act = lambda p: lambda d: self._collectives(p, d)  # noqa: E731
        self.dp_stream = [Stream(self, after=lambda p=p: self.pump(p), active=act(p)) for p in range(P)]
        # the deadline queue's second stream: deferred buckets, one at a time, none while an urgent
        # reduction is in flight, the rest at the iteration's end in deadline order
        self.defer_stream = [Stream(self, after=lambda p=p: self.pump(p), active=act(p)) for p in range(P)]
        self.pending: list[list] = [[] for _ in range(P)]  # (deadline, chunk, bucket, phases, done), in launch order
        self.tie_stream = [Stream(self, active=act(p)) for p in range(P)]
        self.arrived: dict[tuple, float] = {}  # (iteration, message key) -> arrival time
        self.recv_waiters: dict[tuple, Callable[[float], None]] = {}
        self.red_done: dict[tuple, float] = {}  # (p, chunk, iteration, "dp"|"tie") -> completion
        self.red_waiters: dict[tuple, list] = {}
        self.gathers: dict[tuple, float | None] = {}  # (p, chunk) -> when its step's all-gather lands (None: not yet)
        self.gather_waiters: dict[tuple, list] = {}
        self.tie_launch: dict[tuple, float] = {}  # (iteration, side) -> its dp part done
        self.tie_recv: dict[tuple, float] = {}  # (iteration, side) -> the other end's send arrived
        self.barriers: dict[tuple, list] = {}
        self.iter_end: list[float] = []  # per iteration: when every rank left its end barrier
        self._ended: dict[int, list] = {}
        self._handlers: dict[Op, Callable[[RankState, Action, Rule], bool]] = {
            Op.FORWARD: self._compute,
            Op.BACKWARD: self._compute,
            Op.BACKWARD_INPUT: self._compute,
            Op.BACKWARD_WEIGHT: self._compute,
            Op.SEND_ACT: self._send,
            Op.SEND_GRAD: self._send,
            Op.RECV_ACT: self._recv,
            Op.RECV_GRAD: self._recv,
            Op.LAUNCH_REDUCE: self._launch_reduce,
            Op.WAIT_REDUCE: self._wait_reduce,
            Op.OPTIM_STEP: self._optim_step,
        }

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

    def _collectives(self, p: int, delta: int) -> None:
        """Rank ``p``'s streams started (+1) or ended (-1) a collective: its device's compute slows beside one."""
        before = self.in_flight[p] > 0
        self.in_flight[p] += delta
        if self.device is not None and (self.in_flight[p] > 0) != before:
            self.device[p].set_scale(1.0 / (1.0 + self.slowdown) if self.in_flight[p] else 1.0)

    def busy(self, r: RankState, dur: float, done: Callable[[float], None], start: float | None = None) -> None:
        """``dur`` seconds of this rank's compute from ``start`` (default ``r.t``): on the shared cores if
        there are any, on its device beside its collectives if they slow it, else alone."""
        start = r.t if start is None else start
        if self.cpu is not None:
            self.at(start, lambda: self.link(CPU).add(dur, self.cpu[2], done))
        elif self.device is not None:
            self.at(start, lambda: self.device[r.p].add(dur, 1.0, done))
        else:
            done(start + dur)  # its own device: the end is known now (``done`` resumes the rank then)

    def busy_marked(
        self, r: RankState, start: float, dur: float, marks: list, done: Callable[[float], None], reached: float = 0.0
    ) -> None:
        """``busy`` in pieces: ``marks[i][1](t)`` is called when fraction ``marks[i][0]`` of ``dur`` is done
        (``reached``: the fraction done before ``start``)."""
        if self.cpu is None and self.device is None:  # every mark's time is known now (no recursion per mark)
            t = start
            for f, cb in marks:
                f = min(max(f, reached), 1.0)
                t, reached = t + dur * (f - reached), f
                cb(t)
            done(t + dur * (1.0 - reached))
            return
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
            _, key, weight, nbytes = ph[:4]
            cpu_s = ph[4] if len(ph) > 4 else self.costs.comm_cpu(nbytes)
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

    def step(self, r: RankState) -> None:
        """Run rank ``r``'s actions from ``r.pc`` until one blocks (its handler returns ``False`` and
        arranges for ``step`` to be called again) or the iteration ends."""
        rules = r.rules
        while r.pc < len(rules.actions):
            a, rule = rules.actions[r.pc], rules.rules[r.pc]
            if not self._handlers[a.op](r, a, rule):
                return
        self._end_iteration(r)

    def _launched(self, r: RankState, label: str) -> None:
        r.launches.append((r.it, label))

    def _wait_first(self, r: RankState, phases: list[Phase] | None, label: str, chunk: int) -> bool:
        """Collectives the current action waits for before it runs (on the reduction stream, recorded as
        ``reduce_wait``): True once they are done; else ``r`` is parked and resumes when they are."""
        if not phases or r.prepared == (r.it, r.pc):
            return True
        t0 = r.t

        def done(start: float, t: float) -> None:
            r.prepared = (r.it, r.pc)
            self.ev(r, label, "reduce_wait", t0, t, chunk=chunk, fsdp=True)
            self.resume(r, t)

        self.dp_stream[r.p].submit(r.t, list(phases), done)
        return False

    def _compute(self, r: RankState, a: Action, rule: Rule) -> bool:
        if not self._wait_first(r, self.costs.unshard(r.p, a), f"AG {a.op.value} c{a.chunk} m{a.mb}", a.chunk):
            return False
        for key in ((r.p, a.chunk), (r.p, a.chunk, "tied")) if a.op is Op.FORWARD else ():
            if key not in self.gathers:  # the step's all-gathers land first
                continue
            t_g = self.gathers[key]
            if t_g is None:  # still on the stream: re-check when it is done
                self.gather_waiters.setdefault(key, []).append(lambda t: self.at(self.now, lambda: self.step(r)))
                return False
            del self.gathers[key]
            if t_g > r.t:
                self.ev(r, f"AG c{a.chunk}", "reduce_wait", r.t, t_g, chunk=a.chunk, gather=True)
                self.resume(r, t_g)
                return False
        t0 = r.t
        dur = self.costs.compute(r.p, a) + r.debt + self.overhead
        r.debt = 0.0

        def computed(t: float) -> None:
            self.ev(r, f"{a.op.value} c{a.chunk} m{a.mb}", "compute", t0, t, op=a.op.value, chunk=a.chunk, mb=a.mb)
            if rule.launch_tie is not None:
                self._launch_tie(r, rule.launch_tie, t)
            r.pc += 1
            self.resume(r, t)

        acts = r.rules.actions
        nxt = acts[r.pc + 1] if r.pc + 1 < len(acts) else None
        if a.op in WEIGHT_OPS and nxt is not None and nxt.op is Op.LAUNCH_REDUCE and nxt.chunk == a.chunk:
            early = [(f, ph) for f, ph in self.costs.reduce_buckets(r.p, a.chunk) if f is not None]
            if early:  # buckets launched during this backward as their gradients complete
                marks = [(f, self._bucket_launcher(r, a.chunk, k, ph)) for k, (f, ph) in enumerate(early)]
                self.busy_marked(r, r.t, dur, marks, computed)
                return False
        self.busy(r, dur, computed)
        return False

    def _bucket_launcher(self, r: RankState, c: int, k: int, phases: list) -> Callable[[float], None]:
        return lambda t: self.dp_stream[r.p].submit(t, list(phases), self.bucket_done(r, c, k))

    def _send(self, r: RankState, a: Action, rule: Rule) -> bool:
        r.debt += self.overhead
        key, weight, lat, nbytes = self.costs.send(r.p, a)
        r.in_flight += 1
        msg = (r.it, message_key(a))
        label = f"{a.op.value} c{a.chunk} m{a.mb}"
        self.ev(r, label, "send", r.t, r.t, chunk=a.chunk, mb=a.mb, peer=a.peer, instant=True)
        self._launched(r, label)

        def delivered(t: float) -> None:
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
            self.at(t_done, lambda: delivered(t_done))
        else:
            self.at(r.t, lambda: self.run_phases([("delay", lat), ("flow", key, weight, nbytes)], delivered))
        r.pc += 1
        return True

    def _recv(self, r: RankState, a: Action, rule: Rule) -> bool:
        msg = (r.it, message_key(a))
        label = f"{a.op.value} c{a.chunk} m{a.mb}"
        self._launched(r, label)
        t_arr = self.arrived.get(msg)
        if t_arr is not None and t_arr <= r.t:
            r.debt += self.overhead
            r.pc += 1
            return True
        if t_arr is None:
            t0 = r.t

            def got(t: float) -> None:
                r.debt += self.overhead
                if t > t0:
                    self.ev(r, label, "recv_wait", t0, t, chunk=a.chunk, mb=a.mb, peer=a.peer)
                r.pc += 1
                self.resume(r, t)

            self.recv_waiters[msg] = got
            return False
        self.ev(r, label, "recv_wait", r.t, t_arr, chunk=a.chunk, mb=a.mb, peer=a.peer)
        r.debt += self.overhead
        r.pc += 1
        self.resume(r, t_arr)
        return False

    def _launch_reduce(self, r: RankState, a: Action, rule: Rule) -> bool:
        if not self._wait_first(r, self.costs.blocking_reduce(r.p, a.chunk), f"RS c{a.chunk}", a.chunk):
            return False
        r.debt += self.overhead
        if rule.launch_tie is not None:  # first: the other end waits for it, the chunk's buckets only this rank
            self._launch_tie(r, rule.launch_tie, r.t)
        self._launched(r, f"LR c{a.chunk}")
        self.launch_reduce(r, a.chunk, rule.deferred)
        r.pc += 1
        return True

    def _reduced(self, r: RankState, chunks, it: int) -> float | None:
        """When the reductions (and tied copies) of ``chunks`` launched in iteration ``it`` are all done;
        ``None`` (and ``r`` parked until one of them is) while any is not."""
        need = [(r.p, c, it, "dp") for c in chunks]
        need += [(r.p, c, it, "tie") for c in chunks if self.costs.tie(r.p, c) is not None]
        missing = [k for k in need if k not in self.red_done]
        if missing:  # re-check once it is done (the rank's clock stays where it blocked)
            self.red_waiters.setdefault(missing[0], []).append(lambda t: self.at(self.now, lambda: self.step(r)))
            return None
        return max((self.red_done[k] for k in need), default=r.t)

    def _wait_reduce(self, r: RankState, a: Action, rule: Rule) -> bool:
        it = r.it - 1 if rule.deferred else r.it
        if it < 0:  # a deferred WR in the first iteration: nothing was launched before it
            r.pc += 1
            return True
        t_done = self._reduced(r, [a.chunk], it)
        if t_done is None:
            return False
        r.debt += self.overhead
        if t_done > r.t:
            self.ev(r, f"WR c{a.chunk}", "reduce_wait", r.t, t_done, chunk=a.chunk, deferred=rule.deferred)
        r.pc += 1
        if rule.step_early and self.policy.early_steps:
            r.stepped_early.add(a.chunk)
            r.t = max(r.t, t_done)
            return self._optim(r, a.chunk, early=True)
        if t_done > r.t:
            self.resume(r, t_done)
            return False
        return True

    def _optim_step(self, r: RankState, a: Action, rule: Rule) -> bool:
        if rule.deferred and r.it == 0:  # nothing was launched before it
            r.pc += 1
            return True
        if rule.before_steps and not self._before_steps(r):
            return False
        r.pc += 1
        if a.chunk in r.stepped_early:
            r.debt += self.overhead
            return True
        return self._optim(r, a.chunk, deferred=rule.deferred)

    def _before_steps(self, r: RankState) -> bool:
        """The iteration's global work before its first step: a barrier of the pipeline (after this
        iteration's deferred reductions when the norm needs them); ``False`` while ``r`` is parked."""
        if self.policy.clip and r.deferred:
            t_done = self._reduced(r, sorted(r.deferred), r.it)
            if t_done is None:
                return False
            if t_done > r.t:
                self.ev(r, "WR for norm", "reduce_wait", r.t, t_done, for_norm=True)
                r.t = t_done
        cost = self.costs.before_steps()
        if cost is None:
            return True
        if not any(q is r for q in self.barriers.get(("clip", r.it), [None, []])[1]):
            self._launched(r, "clip")
        return self.barrier(r, ("clip", r.it), cost, "clip", "optim")

    def _optim(self, r: RankState, c: int, **args) -> bool:
        """Chunk ``c``'s optimizer step from ``r.t`` (with the executor's host work still owed)."""
        dur = self.costs.optim(r.p, c) + r.debt + self.overhead
        r.debt = 0.0
        if dur <= 0:
            self._launch_gather(r, c, r.t)
            return True
        t0 = r.t

        def stepped(t: float) -> None:
            self.ev(r, f"OS c{c}", "optim", t0, t, chunk=c, **args)
            self._launch_gather(r, c, t)
            self.resume(r, t)

        self.busy(r, dur, stepped)
        return False

    def _launch_gather(self, r: RankState, c: int, t: float) -> None:
        """The distributed optimizer's all-gathers at the end of chunk ``c``'s step, queued on the reduction stream:
        those of the chunks it completes the ``gather_order`` of (its own, where it holds none back); the next
        forward of each waits for its own. A split tied copy's half goes on the tie's stream at once."""
        pair = None if c in r.tied_apart else self.costs.pair_gather(r.p, c)
        if pair:  # (the pair's group: beside the dp all-gather, in order with the tie's exchange)
            self.tie_stream[r.p].submit(t, list(pair), self._gathered((r.p, c, "tied")))
        for g in r.gathers.step(c):
            phases = self.costs.gather(r.p, g, without_tied=g in r.tied_apart)
            if phases:
                self.dp_stream[r.p].submit(t, list(phases), self._gathered((r.p, g)))
        r.tied_apart.discard(c)

    def _gathered(self, key: tuple) -> Callable:
        """``done(start, end)`` of an all-gather the next forward of ``key``'s chunk waits for."""
        self.gathers[key] = None

        def done(start: float, end: float) -> None:
            self.gathers[key] = end
            for w in self.gather_waiters.pop(key, []):
                w(end)

        return done

    def _step_ties_early(self, r: RankState) -> None:
        """``early_tie`` (the executor's ``end_iteration``): a deferred chunk's tied slice steps once every rank has
        finished the iteration and its all-gather joins the deferred buckets, by the deadline of the chunk's first
        forward of the next iteration (over dp), or starts at once (the pair's, where the ends split the copy). (The
        wait for the tie's last part, the other end's rows, is not modelled: they are a few KB, sent at the other
        end's iteration end; nor the embedding's wait for the head's half, which steps at about the same time.)"""
        if not self.policy.early_steps:
            return
        for c, deadline in sorted(r.rules.early_tie.items()):
            phases = self.costs.tied_gather(r.p, c)
            if not phases:
                continue
            if self.costs.tied_gather_queued(r.p, c):
                self.pending[r.p].append((deadline, c, -1, list(phases), self._gathered((r.p, c, "tied"))))
            else:  # (the pair's group: no dp bucket ahead of it)
                self.tie_stream[r.p].submit(r.t, list(phases), self._gathered((r.p, c, "tied")))
            r.tied_apart.add(c)

    def _end_iteration(self, r: RankState) -> None:
        """Pay the executor's remaining host work, wait for this rank's sends, end the step, meet in
        the loss all-reduce."""
        if r.debt > 0:
            debt, r.debt = r.debt, 0.0
            self.busy(r, debt, lambda t: self.resume(r, t))
            return
        if r.in_flight:
            r.waiting_sends = True
            return
        if r.last_send > r.t:
            self.ev(r, "send wait", "send", r.t, r.last_send)
            r.t = r.last_send
        if not r.step_closed:
            self.ev(r, f"step {r.it}", "step", r.step_start, r.t)
            r.step_closed = True
        cost = self.costs.end_of_iteration()
        if cost is not None and not self.barrier(r, ("loss", r.it), cost, None, None):
            return
        self.iter_end_mark(r)

    def iter_end_mark(self, r: RankState) -> None:
        ends = self._ended.setdefault(r.it, [])
        ends.append(r.t)
        if len(ends) == len(self.ranks):
            self.iter_end.append(max(ends))
        self._step_ties_early(r)
        self.release_deferred(r.p, r.t)
        r.it += 1
        r.pc = 0
        r.last_send = 0.0
        r.step_closed = False
        r.stepped_early.clear()
        r.gathers = GatherRelease(r.rules.gather_order)
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
        t_rel = max(b[2].values()) + cost + self.queued_ahead(key[0])
        b[0] = t_rel
        for q in b[1]:
            self.at(t_rel, lambda q=q: self.step(q))
        return False

    def queued_ahead(self, meeting: str) -> float:
        """Seconds a meeting's small collective waits behind the bulk transfers in flight on the nodes' interfaces:
        a FIFO holds up to ``costs.queue_cap`` of them ahead of it (a bulk TCP transfer keeps it full while that
        much is left to send); the slowest interface's wait."""
        cap = self.costs.queue_cap(meeting)
        if cap <= 0:
            return 0.0
        return max((min(ln.backlog() / ln.bw, cap) for k, ln in self.links.items() if k[0] == "nic"), default=0.0)

    # ---------------------------------------------------------------- reductions
    def _reduction_done(self, r: RankState, c: int, it: int) -> Callable:
        """``done(kind, start, end, record=True)`` of chunk ``c``'s reduction (``kind`` "dp" or "tie")."""

        def done(kind: str, start: float, t: float, record: bool = True) -> None:
            if kind == "dp" and record and it >= self.record_from:
                args = {"chunk": c}
                r.events.append(
                    {
                        "name": f"reduce c{c}",
                        "kind": "reduce",
                        "rank": r.p,
                        "start": start,
                        "end": t,
                        "step": it,
                        "args": args,
                    }
                )
            key = (r.p, c, it, kind)
            self.red_done[key] = t
            for w in self.red_waiters.pop(key, []):
                w(t)

        return done

    def launch_reduce(self, r: RankState, c: int, deferred: bool) -> None:
        self.ev(r, f"LR c{c}", "reduce_launch", r.t, r.t, chunk=c, instant=True)
        done = self._reduction_done(r, c, r.it)
        buckets = self.costs.deferred_buckets(r.p, c) if deferred else None
        if buckets:
            self.queue_deferred(r, c, buckets, done)
            return
        at_lr = [ph for f, phases in self.costs.reduce_buckets(r.p, c) if f is None for ph in phases]
        self.dp_stream[r.p].submit(r.t, at_lr, lambda s, t: done("dp", s, t))

    def _launch_tie(self, r: RankState, c: int, t: float) -> None:
        """The tied copy's dp part on the reduction stream; the exchange with the other end once it is done."""
        tie = self.costs.tie(r.p, c)
        if tie is None:
            return
        self._launched(r, f"tie c{c}")
        it, side = r.it, 0 if c == 0 else 1
        self.dp_stream[r.p].submit(t, list(tie["dp"]), lambda s, t2: self._tie_dp_done(it, side, t2))

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

        deadline = r.rules.deadline_of(c)
        for k, phases in enumerate(buckets):
            self.pending[r.p].append((deadline, c, k, list(phases), lambda s, t, k=k: bucket_done(s, t, k)))
        self.pump(r.p)

    def pump(self, p: int) -> None:
        """Issue rank ``p``'s next deferred bucket if no urgent reduction and no deferred bucket is in flight
        (all of them at once with clipping: nothing is held back then)."""
        q = self.pending[p]
        if not q:
            return
        if not self.policy.hold_deferred:
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
        last = self.sched.segments - 1
        return (0, 0) if side == 0 else (self.sched.rank_of(last), last)

    def _tie_done(self, p: int, c: int, it: int, t: float) -> None:
        key = (p, c, it, "tie")
        self.red_done[key] = t
        for w in self.red_waiters.pop(key, []):
            w(t)


def run_schedule(sched: Schedule, costs: Costs, iterations: int = 2, record_from: int = 0) -> Sim:
    """Simulate ``iterations`` iterations of ``sched``; returns the finished :class:`Sim`."""
    return Sim(sched, costs, iterations, record_from).run()
