"""Shared resources of the simulated cluster: links shared by the transfers in flight, FIFO streams.

Links are shared fluidly: the ``k`` transfers in flight on a link each get ``bw / W`` where ``W``
sums their weights (a weight ``w`` stands for ``w`` identical transfers of symmetric ranks that
are not simulated). The host's cores, when the ranks of an emulated cluster share them, are such a
link too (:data:`CPU`), whose "bytes" are core-seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Sim(Protocol):
    """The event loop the links and streams run on (:class:`foldtrain.sim.events.Sim`)."""

    now: float

    def at(self, t: float, fn: Callable[[], None]) -> None: ...

    def run_phases(self, phases: list, done: Callable[[float], None]) -> None: ...


# ("delay", seconds[, core-seconds on the shared cores meanwhile]) | ("flow", link_key, weight, nbytes[, core-seconds
# on the shared cores meanwhile; default: a collective's, costs.comm_cpu(nbytes)])
Phase = tuple
CPU = ("cpu",)  # the host's cores, when the ranks share them


class SharedLink:
    """A link of bandwidth ``bw`` bytes/s shared by the flows in flight (weighted processor sharing);
    one unit of weight never gets more than ``cap`` (a rank cannot use more than one core). ``over``
    (the host's cores): the share of ``bw`` left when the flows' weights sum to twice ``bw`` or more,
    linearly from 1 at ``bw`` (more runnable threads than cores switch and evict each other's caches)."""

    __slots__ = ("sim", "bw", "cap", "over", "scale", "flows", "t", "ver", "_next")

    def __init__(self, sim: Sim, bw: float, cap: float = float("inf"), over: float = 1.0):
        self.sim, self.bw, self.cap, self.over = sim, bw, cap, over
        self.scale = 1.0  # the share of ``bw`` left to the flows (a device's compute beside its collectives)
        self.flows: dict[int, list] = {}
        self.t = 0.0
        self.ver = 0
        self._next = 0

    def set_scale(self, scale: float) -> None:
        """From now on the flows get ``scale`` of the bandwidth."""
        now = self.sim.now
        self._advance(now)
        self.scale = scale
        self._reschedule(now)

    def rate(self) -> float:
        w = sum(f[1] for f in self.flows.values())
        bw = self.bw * self.scale
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

    def backlog(self) -> float:
        """Bytes still to cross the link now, of every flow in flight (a weight stands for that many transfers)."""
        self._advance(self.sim.now)
        return sum(f[0] * f[1] for f in self.flows.values())

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

    def __init__(self, sim: Sim, after: Callable[[], None] | None = None, active: Callable[[int], None] | None = None):
        self.sim = sim
        self.queue: list = []
        self.busy = False
        self.after = after
        self.active = active  # called with +1 as a job starts and -1 as it ends

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

        def begin() -> None:
            if self.active is not None:
                self.active(1)
            self.sim.run_phases(list(phases), finish)

        def finish(t: float) -> None:
            if self.active is not None:
                self.active(-1)
            done(start, t)
            self._start_next()
            if self.after is not None:
                self.after()

        self.sim.at(start, begin)
