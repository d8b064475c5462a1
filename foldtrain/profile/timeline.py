"""Per-rank event recorder (torch-free; a disabled recorder costs well under 1 µs a span).

Every pipeline rank owns one :class:`Timeline`; the executor wraps what it does
in :meth:`Timeline.span` (or reports already-timed work with
:meth:`Timeline.record`) and brackets each training iteration with
:meth:`Timeline.begin_step` / :meth:`Timeline.end_step`::

    tl = Timeline(rank, enabled=cfg.profile)
    tl.begin_step(step)
    with tl.span("F c2 m1", "compute", op="F", chunk=2, mb=1):
        ...
    with tl.span("RA c2 m1", "recv_wait", chunk=2, mb=1, peer=1):
        work.wait()
    tl.end_step(step)

An event is a plain dict ``{name, kind, rank, start, end, step, args}``; times
are seconds of ``clock`` (``time.perf_counter`` by default) plus the offset set
by :meth:`Timeline.align`. ``step`` is the step open when the event was
recorded (``None`` outside ``begin_step`` / ``end_step``). ``end_step`` adds a
``"step"`` event spanning the rank's iteration: the analysis takes a step's
window from the earliest of them to the latest over ranks.

Kinds (:data:`KINDS`):

* ``compute``       -- forward / backward / fused head+loss (``args["op"]``: ``"F"``,
  ``"B"``, a split backward's ``"I"`` / ``"W"``, or e.g. ``"FB"``; ``chunk``, ``mb``);
* ``recv_wait``     -- blocked on a point-to-point receive;
* ``send``          -- posting / completing a send;
* ``reduce_launch`` -- launching a chunk's data-parallel reduction (``chunk``);
* ``reduce_wait``   -- blocked on a data-parallel reduction (``chunk``);
* ``reduce``        -- a reduction in flight, launch -> completion, when known
  (e.g. from CUDA events, or the simulator);
* ``optim``         -- optimizer step (``chunk`` when per chunk);
* ``other``         -- anything else (evaluation, data loading, ...);
* ``step``          -- the iteration window (written by ``end_step``).

Clocks of different processes have different epochs. ``Timeline`` captures
``wall_base = time.time() - clock()`` when it is created (and again in
:func:`gather_timelines`), so ``t + wall_base`` is a wall-clock time;
:func:`gather_timelines` uses these bases to move every rank's events onto rank
0's clock and collects them on rank 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

KINDS = ("compute", "recv_wait", "send", "reduce_launch", "reduce_wait", "reduce", "optim", "other", "step")
_KIND_SET = frozenset(KINDS)


class _NullSpan:
    """The shared do-nothing context manager a disabled timeline hands out.

    Its ``__enter__`` / ``__exit__`` are C builtins, so ``with`` runs no Python
    frame (~0.2 µs cheaper than Python methods): ``tuple()`` returns ``()``, and
    ``"".format(exc_type, exc, tb)`` ignores its arguments and returns ``""``,
    which is falsy, so exceptions propagate.
    """

    __slots__ = ()
    __enter__ = staticmethod(tuple)
    __exit__ = staticmethod("".format)


NULL_SPAN = _NullSpan()


class _Span:
    """A compute span also keeps the CPU seconds its thread ran in it (``args["cpu_s"]``): on shared cores
    the share of the span the rank had a core; on a GPU the host's time in it."""

    __slots__ = ("_tl", "_name", "_kind", "_args", "_start", "_step", "_cpu")

    def __init__(self, tl: Timeline, name: str, kind: str, args: dict) -> None:
        self._tl = tl
        self._name = name
        self._kind = kind
        self._args = args

    def __enter__(self) -> _Span:
        self._step = self._tl.step
        self._cpu = time.thread_time() if self._kind == "compute" else None
        self._start = self._tl.clock()
        return self

    def __exit__(self, *exc: object) -> bool:
        tl = self._tl
        end = tl.clock()
        if self._cpu is not None:
            self._args = {**self._args, "cpu_s": time.thread_time() - self._cpu}
        off = tl.offset
        tl.events.append(
            {
                "name": self._name,
                "kind": self._kind,
                "rank": tl.rank,
                "start": self._start + off,
                "end": end + off,
                "step": self._step,
                "args": self._args,
            }
        )
        return False


def _check_kind(kind: str) -> None:
    if kind not in _KIND_SET:
        raise ValueError(f"unknown timeline event kind {kind!r}; use one of {', '.join(KINDS)}")


class Timeline:
    """Records one rank's events; every method is a no-op when ``enabled`` is false."""

    def __init__(self, rank: int, enabled: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rank = int(rank)
        self.enabled = bool(enabled)
        self.clock = clock
        self.events: list[dict[str, Any]] = []
        self.step: int | None = None
        self.offset = 0.0
        self._step_start: float | None = None
        self._step_cpu = 0.0
        # event time + wall_base = wall-clock seconds (time.time()), for cross-rank alignment
        self.wall_base = 0.0
        self.calibrate()

    # ------------------------------------------------------------------ recording

    def span(self, name: str, kind: str, **args: Any):
        """Context manager recording ``[enter, exit]`` as one event (even if the body raises)."""
        if not self.enabled:
            return NULL_SPAN
        if kind not in _KIND_SET:
            _check_kind(kind)
        return _Span(self, name, kind, args)

    def record(self, name: str, kind: str, start: float, end: float, **args: Any) -> None:
        """Add an event timed elsewhere; ``start`` / ``end`` in seconds of this timeline's clock."""
        if not self.enabled:
            return
        _check_kind(kind)
        if end < start:
            raise ValueError(f"event {name!r} ends ({end}) before it starts ({start})")
        off = self.offset
        self.events.append(
            {
                "name": name,
                "kind": kind,
                "rank": self.rank,
                "start": start + off,
                "end": end + off,
                "step": self.step,
                "args": args,
            }
        )

    def instant(self, name: str, kind: str = "other", **args: Any) -> None:
        """A zero-length event now (``args["instant"] = True``)."""
        if not self.enabled:
            return
        _check_kind(kind)
        t = self.clock() + self.offset
        args["instant"] = True
        self.events.append(
            {"name": name, "kind": kind, "rank": self.rank, "start": t, "end": t, "step": self.step, "args": args}
        )

    def begin_step(self, step: int) -> None:
        """Open iteration ``step``: events recorded until :meth:`end_step` carry ``step``."""
        if not self.enabled:
            return
        self.step = step
        self._step_cpu = time.process_time()
        self._step_start = self.clock()

    def end_step(self, step: int | None = None) -> None:
        """Close the open iteration and record its ``"step"`` window event, with the CPU seconds the whole
        process ran in it (``args["cpu_s"]``: every thread's, the collectives' and the allocator's too)."""
        if not self.enabled:
            return
        end = self.clock()
        cpu = time.process_time() - self._step_cpu
        if step is None:
            step = self.step
        start = self._step_start if self._step_start is not None else end
        off = self.offset
        self.events.append(
            {
                "name": f"step {step}",
                "kind": "step",
                "rank": self.rank,
                "start": start + off,
                "end": end + off,
                "step": step,
                "args": {"cpu_s": cpu},
            }
        )
        self.step = None
        self._step_start = None

    # ------------------------------------------------------------------ time base

    def calibrate(self, samples: int = 5) -> float:
        """Re-measure ``wall_base`` (``time.time() - clock()``, net of :meth:`align` offsets) and return it.

        Takes the sample whose two clock reads bracket ``time.time()`` most tightly.
        Done at creation and by :func:`gather_timelines`.
        """
        best = None
        for _ in range(max(samples, 1)):
            a = self.clock()
            w = time.time()
            b = self.clock()
            if best is None or b - a < best[0]:
                best = (b - a, w - (a + b) / 2)
        self.wall_base = best[1] - self.offset
        return self.wall_base

    def align(self, offset_s: float) -> None:
        """Shift every recorded and future event by ``offset_s`` seconds (e.g. onto rank 0's clock)."""
        offset_s = float(offset_s)
        if not offset_s:
            return
        for ev in self.events:
            ev["start"] += offset_s
            ev["end"] += offset_s
        self.offset += offset_s
        self.wall_base -= offset_s

    def clear(self) -> None:
        """Drop the recorded events (keeps the clock alignment and the open step)."""
        self.events.clear()

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "offset": self.offset, "wall_base": self.wall_base, "events": self.events}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Timeline:
        tl = cls(d["rank"], enabled=True)
        tl.offset = float(d.get("offset", 0.0))
        tl.wall_base = float(d.get("wall_base", tl.wall_base))
        tl.events = [dict(ev, args=dict(ev.get("args") or {})) for ev in d["events"]]
        return tl

    @classmethod
    def from_json(cls, s: str) -> Timeline:
        return cls.from_dict(json.loads(s))

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"Timeline(rank={self.rank}, enabled={self.enabled}, events={len(self.events)})"


def shifted_events(events: list[dict[str, Any]], offset_s: float) -> list[dict[str, Any]]:
    """Copies of ``events`` moved by ``offset_s`` seconds."""
    return [dict(ev, start=ev["start"] + offset_s, end=ev["end"] + offset_s) for ev in events]


def gather_timelines(timeline: Timeline, group: Any = None) -> list[list[dict[str, Any]]] | None:
    """Collect every rank's events on the group's rank 0, on rank 0's clock.

    Collective over ``group`` (default: the world): every rank of it must call it
    (with NCCL, after ``torch.cuda.set_device``, as any object collective).
    Clock offsets come from the wall clock: after a barrier each rank re-measures
    its ``wall_base`` (``time.time() - perf_counter()``, see :meth:`Timeline.calibrate`;
    first captured when the timeline was created), the bases are all-gathered, and
    rank ``r``'s events are shifted by ``wall_base[r] - wall_base[0]``. That is
    exact to a few µs between processes of one host and as good as NTP across
    hosts. The recorded events are not modified.

    Returns the list of per-rank event lists (index = rank in ``group``) on the
    group's rank 0 and ``None`` elsewhere; without an initialised process group,
    ``[timeline.events]`` (copies).
    """
    steps = gather_steps(timeline, [timeline.events], group)
    return None if steps is None else steps[0]


def gather_steps(
    timeline: Timeline, steps: list[list[dict[str, Any]]], group: Any = None
) -> list[list[list[dict[str, Any]]]] | None:
    """:func:`gather_timelines` for several groups of events at once (e.g. the events of each of the last
    steps, recorded by ``timeline``; every rank passes as many): per group, the per-rank event lists, on
    the group's rank 0 (``None`` elsewhere). One collective whatever the number of groups."""
    import torch.distributed as dist  # lazy: the rest of the module is torch-free

    if not (dist.is_available() and dist.is_initialized()):
        return [[shifted_events(events, 0.0)] for events in steps]
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.barrier(group=group)
    bases: list[Any] = [None] * world
    dist.all_gather_object(bases, float(timeline.calibrate()), group=group)
    mine = [shifted_events(events, bases[me] - bases[0]) for events in steps]
    out: list[Any] | None = [None] * world if me == 0 else None
    dist.gather_object(mine, out, dst=dst, group=group)
    if me != 0:
        return None
    if len({len(r) for r in out}) != 1:
        raise RuntimeError(f"gather_steps: the ranks sent different numbers of groups ({[len(r) for r in out]})")
    return [[out[r][i] for r in range(world)] for i in range(len(steps))]
