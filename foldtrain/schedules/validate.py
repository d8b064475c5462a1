"""Torch-free checks for schedules.

:func:`validate_schedule` raises :class:`ScheduleError` when a schedule cannot
run correctly; :func:`activations_peak` counts the micro-batch activations a
rank holds at once. Timing lives in :mod:`foldtrain.sim` (``simulate_order``,
and the full simulator behind ``foldtrain simulate``).

Communication model of the symbolic run (``sends="async"``, the default): a
send never blocks (the executor posts it with ``isend`` and only waits for its
completion later, e.g. at the end of the iteration); a recv blocks until the
matching send has been executed. ``sends="rendezvous"`` is stricter and models
NCCL without buffering: every run of consecutive send / recv actions on a rank
is posted as one group (``batch_isend_irecv``) and the rank waits until every
operation of the group has met its partner, which must be posted too.

Channels: NCCL point-to-point has no tags, so transfers from one rank to
another are matched in posting order. ``channels="per-pair"`` (default, the
strict check) requires, for every ordered pair (src, dst), that the sends of
src to dst -- activations and gradients together -- come in the same order as
dst's receives from src, so one channel per direction is safe.
``channels="per-kind"`` only requires it per (src, dst, kind), for an
executor that keeps activations and gradients on separate channels, as foldtrain's does
for the V placement (zbv; :func:`channels_of`).

The executor must honour the async model: never block on a send before later
actions are issued. With NCCL that means sends must not sit in front of later
receives on the same stream, e.g. one communicator per direction (src -> dst),
or receives pre-posted in list order. A plain executor that batches each run
of consecutive send / recv actions on one stream is the ``rendezvous`` model:
gpipe and 1f1b pass it, interleaved-1f1b and fold deadlock under it for
many shapes.
"""

from __future__ import annotations

from collections import defaultdict

from .actions import (
    BACKWARD_OPS,
    COMM_OPS,
    COMPUTE_OPS,
    RECV_OPS,
    REDUCE_OPS,
    SEND_OPS,
    WEIGHT_OPS,
    Action,
    Op,
    Schedule,
    message_key,
)


class ScheduleError(ValueError):
    """A schedule that cannot run correctly."""


def _where(rank: int, i: int, a: Action) -> str:
    return f"rank {rank} action #{i} {a}"


def _check_structure(sched: Schedule) -> None:
    pp, v, m = sched.pp, sched.virtual, sched.microbatches
    n_seg = pp * v
    if len(sched.ranks) != pp:
        raise ScheduleError(f"schedule has {len(sched.ranks)} rank lists for pp={pp}")
    for p, acts in enumerate(sched.ranks):
        for i, a in enumerate(acts):
            w = _where(p, i, a)
            if not isinstance(a, Action) or not isinstance(a.op, Op):
                raise ScheduleError(f"{w}: not an Action")
            if not 0 <= a.chunk < n_seg:
                raise ScheduleError(f"{w}: segment {a.chunk} outside [0, {n_seg})")
            if sched.rank_of(a.chunk) != p:
                raise ScheduleError(f"{w}: segment {a.chunk} lives on rank {sched.rank_of(a.chunk)}, not {p}")
            if a.op in REDUCE_OPS:
                if a.mb is not None or a.peer is not None:
                    raise ScheduleError(f"{w}: reduction actions take no micro-batch or peer")
                continue
            if a.mb is None or not 0 <= a.mb < m:
                raise ScheduleError(f"{w}: micro-batch {a.mb} outside [0, {m})")
            if a.op in COMPUTE_OPS:
                if a.peer is not None:
                    raise ScheduleError(f"{w}: compute actions take no peer")
                continue
            # the neighbour segment this transfer talks to
            other = a.chunk + (1 if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1)
            if not 0 <= other < n_seg:
                raise ScheduleError(f"{w}: segment {a.chunk} has no neighbour segment {other} to talk to")
            if a.peer != sched.rank_of(other) or a.peer == p:
                raise ScheduleError(
                    f"{w}: peer must be rank {sched.rank_of(other)} (holder of segment {other}), got {a.peer}"
                )


def _check_compute(sched: Schedule) -> None:
    """Every (segment, micro-batch) has one ``F`` and one backward: a ``B``, or an ``I`` and a ``W``."""
    expected = {(s, mb) for s in range(sched.segments) for mb in range(sched.microbatches)}
    seen: dict[Op, dict[tuple[int, int], int]] = {op: defaultdict(int) for op in COMPUTE_OPS}
    for acts in sched.ranks:
        for a in acts:
            if a.op in COMPUTE_OPS:
                seen[a.op][(a.chunk, a.mb)] += 1
    for op, counts in seen.items():
        dup = sorted(k for k, n in counts.items() if n > 1)
        if dup:
            s, mb = dup[0]
            raise ScheduleError(f"{op.value}(c{s},m{mb}) appears {counts[dup[0]]} times; each must appear at most once")
    split = set(seen[Op.BACKWARD_INPUT]) | set(seen[Op.BACKWARD_WEIGHT])
    for s, mb in sorted(expected):
        where = f"rank {sched.rank_of(s)}"
        if (s, mb) not in seen[Op.FORWARD]:
            raise ScheduleError(f"F(c{s},m{mb}) is missing on {where}")
        whole, i, w = ((s, mb) in seen[op] for op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))
        if whole and (s, mb) in split:
            raise ScheduleError(
                f"(c{s},m{mb}) has both B and a split backward (I/W) on {where}; give it one or the other"
            )
        if not whole and not (i and w):
            missing = "B" if (s, mb) not in split else ("W" if i else "I")
            raise ScheduleError(f"{missing}(c{s},m{mb}) is missing on {where}")
    before = {Op.BACKWARD: Op.FORWARD, Op.BACKWARD_INPUT: Op.FORWARD, Op.BACKWARD_WEIGHT: Op.BACKWARD_INPUT}
    what = {Op.FORWARD: "backward before its forward", Op.BACKWARD_INPUT: "weight gradient before its input gradient"}
    for p, acts in enumerate(sched.ranks):
        pos = {(a.op, a.chunk, a.mb): i for i, a in enumerate(acts) if a.op in COMPUTE_OPS}
        for i, a in enumerate(acts):
            need = before.get(a.op)
            if need is not None and pos[(need, a.chunk, a.mb)] > i:
                raise ScheduleError(f"{_where(p, i, a)}: {what[need]} (#{pos[(need, a.chunk, a.mb)]})")


def _channel(kind: str, src: int, dst: int, channels: str) -> tuple:
    return (src, dst) if channels == "per-pair" else (src, dst, kind)


def _check_comms(sched: Schedule, channels: str) -> dict[tuple, tuple[int, int]]:
    """Match sends with recvs; returns key -> (rank, index) of every send."""
    sends: dict[tuple, tuple[int, int]] = {}
    recvs: dict[tuple, tuple[int, int]] = {}
    for p, acts in enumerate(sched.ranks):
        for i, a in enumerate(acts):
            if a.op not in COMM_OPS:
                continue
            key = message_key(a)
            table = sends if a.op in SEND_OPS else recvs
            if key in table:
                q, j = table[key]
                raise ScheduleError(f"{_where(p, i, a)} repeats {_where(q, j, sched.ranks[q][j])}")
            table[key] = (p, i)
    for key, (p, i) in sends.items():
        if key not in recvs:
            a = sched.ranks[p][i]
            raise ScheduleError(f"{_where(p, i, a)} has no matching recv on rank {a.peer}")
    for key, (p, i) in recvs.items():
        if key not in sends:
            a = sched.ranks[p][i]
            raise ScheduleError(f"{_where(p, i, a)} has no matching send on rank {a.peer}")
    # NCCL has no tags: per channel, the order of sends must equal the order of recvs
    sent: dict[tuple, list[tuple[tuple, int, int]]] = defaultdict(list)
    got: dict[tuple, list[tuple[tuple, int, int]]] = defaultdict(list)
    for p, acts in enumerate(sched.ranks):
        for i, a in enumerate(acts):
            if a.op in SEND_OPS:
                key = message_key(a)
                sent[_channel(key[0], p, a.peer, channels)].append((key, p, i))
            elif a.op in RECV_OPS:
                key = message_key(a)
                got[_channel(key[0], a.peer, p, channels)].append((key, p, i))
    for ch, seq in sent.items():
        for (k1, p1, i1), (k2, p2, i2) in zip(seq, got[ch]):
            if k1 != k2:
                raise ScheduleError(
                    f"send/recv order mismatch on channel {ch} (NCCL matches in order): "
                    f"{_where(p2, i2, sched.ranks[p2][i2])} would receive the data of "
                    f"{_where(p1, i1, sched.ranks[p1][i1])}"
                )
    return sends


def _check_reductions(sched: Schedule) -> None:
    for p, acts in enumerate(sched.ranks):
        last_compute = max((i for i, a in enumerate(acts) if a.op in COMPUTE_OPS), default=-1)
        for c in sched.chunks_of(p):
            pos: dict[Op, list[int]] = {op: [] for op in REDUCE_OPS}
            for i, a in enumerate(acts):
                if a.op in REDUCE_OPS and a.chunk == c:
                    pos[a.op].append(i)
            for op in (Op.LAUNCH_REDUCE, Op.WAIT_REDUCE, Op.OPTIM_STEP):
                if len(pos[op]) != 1:
                    raise ScheduleError(f"rank {p} chunk c{c}: {len(pos[op])} {op.value} actions, need exactly one")
            lr, wr, os_ = pos[Op.LAUNCH_REDUCE][0], pos[Op.WAIT_REDUCE][0], pos[Op.OPTIM_STEP][0]
            first_f = min(i for i, a in enumerate(acts) if a.op is Op.FORWARD and a.chunk == c)
            last_b = max(i for i, a in enumerate(acts) if a.op in WEIGHT_OPS and a.chunk == c)
            if lr < last_b:
                raise ScheduleError(f"rank {p} chunk c{c}: LR at #{lr} before the chunk's last backward at #{last_b}")
            if sched.dp_sync == "after-flush" and lr < last_compute:
                raise ScheduleError(
                    f"rank {p} chunk c{c}: dp_sync after-flush but LR at #{lr} precedes compute at #{last_compute}"
                )
            if wr < first_f:  # deferred: previous iteration's reduction, applied before this forward
                if not sched.defer_reduce:
                    raise ScheduleError(
                        f"rank {p} chunk c{c}: WR at #{wr} before the chunk's forward but defer_reduce is off"
                    )
                if not wr < os_ < first_f:
                    raise ScheduleError(
                        f"rank {p} chunk c{c}: deferred WR/OS must both precede the first forward at #{first_f}"
                    )
            elif sched.defer_reduce and wr < lr:
                raise ScheduleError(
                    f"rank {p} chunk c{c}: WR at #{wr} is neither after LR (#{lr}) nor, deferred, "
                    f"before the chunk's first forward (#{first_f})"
                )
            elif not lr < wr < os_:
                raise ScheduleError(f"rank {p} chunk c{c}: need LR < WR < OS, got #{lr}, #{wr}, #{os_}")


def _local_ready(a: Action, done: set[tuple], p: int, sched: Schedule, deferred: set[int]) -> str | None:
    """None when the local inputs of ``a`` exist, else what is missing."""
    n_seg = sched.segments
    if a.op is Op.FORWARD:
        need = []
        if a.chunk > 0:
            if sched.rank_of(a.chunk - 1) == p:
                need.append((Op.FORWARD, a.chunk - 1, a.mb))
            else:
                need.append((Op.RECV_ACT, a.chunk, a.mb))
        if a.chunk in deferred:
            need.append((Op.OPTIM_STEP, a.chunk, None))
    elif a.op in BACKWARD_OPS:
        need = [(Op.FORWARD, a.chunk, a.mb)]
        if a.chunk < n_seg - 1:
            if sched.rank_of(a.chunk + 1) == p:
                need.append((BACKWARD_OPS, a.chunk + 1, a.mb))
            else:
                need.append((Op.RECV_GRAD, a.chunk, a.mb))
    elif a.op is Op.BACKWARD_WEIGHT:
        need = [(Op.BACKWARD_INPUT, a.chunk, a.mb)]
    elif a.op is Op.SEND_ACT:
        need = [(Op.FORWARD, a.chunk, a.mb)]
    elif a.op is Op.SEND_GRAD:
        need = [(BACKWARD_OPS, a.chunk, a.mb)]
    elif a.op is Op.LAUNCH_REDUCE:
        need = [(WEIGHT_OPS, a.chunk, mb) for mb in range(sched.microbatches)]
    elif a.op is Op.WAIT_REDUCE:
        need = [] if a.chunk in deferred else [(Op.LAUNCH_REDUCE, a.chunk, None)]
    elif a.op is Op.OPTIM_STEP:
        need = [(Op.WAIT_REDUCE, a.chunk, None)]
    else:
        need = []
    for op, s, mb in need:
        ops = op if isinstance(op, frozenset) else (op,)  # a set: any of them will do (B, or its I / W)
        if not any((o, s, mb) in done for o in ops):
            return str(Action(min(ops, key=lambda o: o.value), s, mb))
    return None


def _symbolic_run(sched: Schedule, sends: str) -> None:
    ranks = sched.ranks
    pcs = [0] * sched.pp
    done: list[set[tuple]] = [set() for _ in ranks]
    deferred = [set(sched.deferred_chunks(p)) for p in range(sched.pp)]
    sent: set[tuple] = set()  # message keys whose send executed (async) / was posted (rendezvous)
    posted_recv: set[tuple] = set()

    def group_end(p: int, i: int) -> int:
        j = i
        while j < len(ranks[p]) and ranks[p][j].op in COMM_OPS:
            j += 1
        return j

    progress = True
    while progress:
        progress = False
        for p, acts in enumerate(ranks):
            while pcs[p] < len(acts):
                i = pcs[p]
                a = acts[i]
                if a.op in COMM_OPS and sends == "rendezvous":
                    end = group_end(p, i)
                    group = acts[i:end]
                    for b in group:
                        missing = _local_ready(b, done[p], p, sched, deferred[p])
                        if missing:
                            raise ScheduleError(f"{_where(p, i, b)} needs {missing}, which has not run on rank {p} yet")
                        (sent if b.op in SEND_OPS else posted_recv).add(message_key(b))
                    if all(message_key(b) in (posted_recv if b.op in SEND_OPS else sent) for b in group):
                        for b in group:
                            done[p].add((b.op, b.chunk, b.mb))
                        pcs[p] = end
                        progress = True
                        continue
                    break
                if a.op in RECV_OPS:
                    if message_key(a) not in sent:
                        break
                else:
                    missing = _local_ready(a, done[p], p, sched, deferred[p])
                    if missing:
                        raise ScheduleError(f"{_where(p, i, a)} needs {missing}, which has not run on rank {p} yet")
                    if a.op in SEND_OPS:
                        sent.add(message_key(a))
                done[p].add((a.op, a.chunk, a.mb))
                pcs[p] += 1
                progress = True
    if any(pcs[p] < len(ranks[p]) for p in range(sched.pp)):
        blocked = "; ".join(
            f"rank {p} blocked at #{pcs[p]} {ranks[p][pcs[p]]}" if pcs[p] < len(ranks[p]) else f"rank {p} finished"
            for p in range(sched.pp)
        )
        raise ScheduleError(f"deadlock ({sends} sends): {blocked}")


def channels_of(sched: Schedule) -> str:
    """The channels the executor's transport gives ``sched`` (:mod:`foldtrain.parallel.pipeline.p2p`): one per
    kind and direction for the V placement, whose pairs of ranks carry activations one way and gradients of
    the other chain the same way; one per direction otherwise."""
    return "per-kind" if sched.placement == "v" else "per-pair"


def validate_schedule(sched: Schedule, *, channels: str | None = None, sends: str = "async") -> None:
    """Raise :class:`ScheduleError` unless ``sched`` runs correctly (see module docstring); ``channels``
    defaults to the ones the executor gives it (:func:`channels_of`)."""
    channels = channels or channels_of(sched)
    if channels not in ("per-kind", "per-pair"):
        raise ValueError(f"channels must be per-kind or per-pair, got {channels!r}")
    if sends not in ("async", "rendezvous"):
        raise ValueError(f"sends must be async or rendezvous, got {sends!r}")
    _check_structure(sched)
    _check_compute(sched)
    _check_comms(sched, channels)
    _check_reductions(sched)
    _symbolic_run(sched, sends)


def activations_peak(sched: Schedule, rank: int, per_segment: dict[int, float] | None = None) -> float:
    """Most (segment, micro-batch) forwards on ``rank`` whose backward has not completed yet (its ``B``,
    or its ``W``: the split backward keeps the activations until the weights' gradients are computed);
    with ``per_segment``, the largest sum of their weights (a segment's activation bytes) instead."""
    live = peak = 0
    for a in sched.ranks[rank]:
        if a.op is Op.FORWARD:
            live += 1 if per_segment is None else per_segment[a.chunk]
            peak = max(peak, live)
        elif a.op in WEIGHT_OPS:
            live -= 1 if per_segment is None else per_segment[a.chunk]
    return peak
