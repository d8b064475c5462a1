"""Schedule generators: gpipe, 1f1b, interleaved-1f1b and fold (Fold3D's AIAO), and the zero-bubble
schedules that split the backward into ``I`` and ``W`` (Qi et al., ICLR 2024): zb-h1, zbv,
interleaved-zb and fold-zb.

Each generator only decides the ORDER OF COMPUTE on every rank (a list of
``F`` / ``B`` / ``I`` / ``W`` actions); :func:`insert_comms` and :func:`insert_reductions` then
add the point-to-point transfers and the data-parallel reduction steps the same
way for every schedule. See :mod:`.actions` for the placement and the
send / recv conventions.

Requirements on the micro-batch count ``M`` (checked by :func:`build_schedule`):

* ``gpipe``, ``1f1b``, ``fold``: any ``M >= 1``. ``1f1b`` with ``M < P`` is
  legal: rank ``p`` warms up with ``min(P - p - 1, M)`` forwards, so the early
  ranks degenerate to all-forward-then-all-backward; the pipeline is just never
  full. ``fold`` with ``M < P`` is legal too but rank 0 idles at each
  wrap-around, waiting for the last rank's previous chunk.
* ``interleaved-1f1b`` and ``interleaved-zb``: ``M`` a multiple of ``P`` (hence ``M >= P``), as in
  Megatron-LM's ``forward_backward_pipelining_with_interleaving`` whose
  chunk / micro-batch mapping works on groups of ``P`` micro-batches.
* ``zb-h1``, ``fold-zb``, ``zbv``: any ``M >= 1`` (``zbv`` needs ``--parallel.virtual 2``: its V
  placement, :mod:`.actions`).
"""

from __future__ import annotations

from foldtrain.errors import ConfigError

from .actions import BACKWARD_OPS, WEIGHT_OPS, Action, Op, Schedule, chunks_of_rank, stage_rank

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "fold", "zb-h1", "zbv", "interleaved-zb", "fold-zb")
SPLIT_BACKWARD = frozenset({"zb-h1", "zbv", "interleaved-zb", "fold-zb"})  # schedules of I / W actions
_PLACEMENT = {"zbv": "v"}  # schedules whose segments are not placed in a loop (:mod:`.actions`)
DEFERRABLE = frozenset({"fold", "fold-zb"})  # schedules --fold.defer_reduce applies to
DP_SYNC_MODES = ("after-flush", "per-chunk")

Compute = list[tuple[Op, int, int]]  # (F, B, I or W, global segment, micro-batch)


# --------------------------------------------------------------------------- compute orders


def gpipe_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """All forwards in (mb, chunk) order, then all backwards in reverse (mb desc, chunk desc)."""
    segs = chunks_of_rank(p, pp, virtual)
    fwd = [(Op.FORWARD, s, mb) for mb in range(m) for s in segs]
    bwd = [(Op.BACKWARD, s, mb) for mb in reversed(range(m)) for s in reversed(segs)]
    return fwd + bwd


def one_f_one_b_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """PipeDream-flush / Megatron 1F1B (virtual == 1): warm-up, steady 1F1B, cool-down."""
    assert virtual == 1
    warmup = min(pp - p - 1, m)
    out: Compute = [(Op.FORWARD, p, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        out.append((Op.FORWARD, p, warmup + i))
        out.append((Op.BACKWARD, p, i))
    out += [(Op.BACKWARD, p, mb) for mb in range(m - warmup, m)]
    return out


def megatron_slot(op: Op, k: int, p: int, pp: int, virtual: int) -> tuple[Op, int, int]:
    """Rank ``p``'s ``k``-th ``op`` in Megatron-LM's interleaved mapping: local chunk ``(k // P) % V`` (reversed,
    ``V - 1 - ...``, for the backward's ops) on micro-batch ``(k // (P*V)) * P + k % P``."""
    c = (k // pp) % virtual
    if op is not Op.FORWARD:
        c = virtual - 1 - c
    return (op, c * pp + p, (k // (pp * virtual)) * pp + k % pp)


def interleaved_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    Rank ``p`` runs ``T = V * M`` virtual micro-batches each way, in :func:`megatron_slot`'s mapping.
    Warm-up: ``min((P - p - 1) * 2 + (V - 1) * P, T)`` forwards; then
    ``F(w + k), B(k)`` pairs; then the remaining backwards.
    """
    total = virtual * m
    warmup = min((pp - p - 1) * 2 + (virtual - 1) * pp, total)
    out: Compute = [megatron_slot(Op.FORWARD, k, p, pp, virtual) for k in range(warmup)]
    for k in range(total - warmup):
        out.append(megatron_slot(Op.FORWARD, warmup + k, p, pp, virtual))
        out.append(megatron_slot(Op.BACKWARD, k, p, pp, virtual))
    out += [megatron_slot(Op.BACKWARD, k, p, pp, virtual) for k in range(total - warmup, total)]
    return out


def fold_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """Fold3D's all-in, all-out (breadth-first): forwards of chunk 0 for every mb, ...
    chunk V-1; then backwards of chunk V-1 for mb descending, ..., chunk 0."""
    segs = chunks_of_rank(p, pp, virtual)
    fwd = [(Op.FORWARD, s, mb) for s in segs for mb in range(m)]
    bwd = [(Op.BACKWARD, s, mb) for s in reversed(segs) for mb in reversed(range(m))]
    return fwd + bwd


def zero_bubble_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """ZB-H1 (``virtual == 1``) and its interleaved form (ZB1P, as torch's ``ScheduleInterleavedZeroBubble``).

    1F1B (or Megatron's interleaved 1F1B, :func:`megatron_slot`'s mapping) with every backward split in
    ``I`` and ``W``: the ``I`` keeps the 1F1B position, so the gradient travels up the pipeline one ``I``
    per hop instead of one ``B``; rank ``p`` holds back its ``W`` by ``p`` micro-batches, and the held
    ones run in the cool-down, where the rank would otherwise wait for the next gradient. Warm-up: 1F1B's
    ``P - p - 1`` forwards, or interleaved 1F1B's ``2 (P - p - 1) + (V - 1) P`` (torch's ZB1P warms up one
    fewer per hop, which breaks the per-pair send / receive order NCCL's untagged channels need). Activations
    live from ``F`` to ``W``: at most ``P`` micro-batches on every rank (1F1B's bound on rank 0), interleaved
    1F1B's rank-0 peak when interleaved.
    """
    total = virtual * m
    warmup = min((pp - p - 1) * (2 if virtual > 1 else 1) + (virtual - 1) * pp, total)
    out: Compute = [megatron_slot(Op.FORWARD, k, p, pp, virtual) for k in range(warmup)]
    weights = 0
    for k in range(total):
        if warmup + k < total:
            out.append(megatron_slot(Op.FORWARD, warmup + k, p, pp, virtual))
        out.append(megatron_slot(Op.BACKWARD_INPUT, k, p, pp, virtual))
        if k >= p:
            out.append(megatron_slot(Op.BACKWARD_WEIGHT, weights, p, pp, virtual))
            weights += 1
    out += [megatron_slot(Op.BACKWARD_WEIGHT, k, p, pp, virtual) for k in range(weights, total)]
    return out


def fold_zb_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """Fold with its weight-gradient work in deadline order: fold's forwards; every ``I`` in fold's backward
    order (chunk ``V-1`` first), so the gradient reaches segment 0 one ``I`` per hop; then the ``W`` of
    chunk 0, 1, ..., ``V-1``: the order in which the NEXT iteration's forwards need the chunks' weights.
    Chunk 0's reduction, which fold starts last and the next step needs first, starts after its own
    ``W`` and overlaps every other chunk's; each later chunk's reduction launches in deadline order."""
    segs = chunks_of_rank(p, pp, virtual)
    fwd = [(Op.FORWARD, s, mb) for s in segs for mb in range(m)]
    inputs = [(Op.BACKWARD_INPUT, s, mb) for s in reversed(segs) for mb in reversed(range(m))]
    weights = [(Op.BACKWARD_WEIGHT, s, mb) for s in segs for mb in reversed(range(m))]
    return fwd + inputs + weights


def placement_of(name: str) -> str:
    """Which rank holds which segment under schedule ``name``: ``"loop"`` or ``"v"`` (:mod:`.actions`)."""
    return _PLACEMENT.get(name, "loop")


def zbv_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """ZB-V (Qi et al., ICLR 2024, Section 6; torch's ``ScheduleZBVZeroBubble``), on the V placement: rank ``p``
    holds the down-going segment ``p`` and the up-going segment ``2P-1-p``.

    Warm-up: ``2(P-p)-1`` forwards of the down segment, then ``p`` pairs (up, down) of forwards, then ``P-p``
    rounds of the up segment's ``F, I, W`` (rank 0's up segment is the last: its gradient is ready at once).
    Steady state: the down segment's ``F, I, W``, then the up segment's, until every forward ran. Cool-down:
    ``p`` pairs of ``I`` (down, up) with their ``W`` held back, then ``P-p`` rounds of the down segment's ``I``
    each followed by its oldest held ``W``, then the held ``W`` of the up segment, then of the down one. The
    phases assume at least ``2P-1`` micro-batches; with fewer the order is built for ``2P-1`` and the
    missing micro-batches' actions are dropped (as torch does)."""
    down, up = p, 2 * pp - 1 - p
    n = max(m, 2 * pp - 1)
    out: Compute = []
    nxt = {(Op.FORWARD, down): 0, (Op.FORWARD, up): 0, (Op.BACKWARD_INPUT, down): 0, (Op.BACKWARD_INPUT, up): 0}
    nxt.update({(Op.BACKWARD_WEIGHT, down): 0, (Op.BACKWARD_WEIGHT, up): 0})

    def emit(op: Op, s: int) -> None:
        out.append((op, s, nxt[(op, s)]))
        nxt[(op, s)] += 1

    for _ in range(2 * (pp - p) - 1):
        emit(Op.FORWARD, down)
    for _ in range(p):
        emit(Op.FORWARD, up)
        emit(Op.FORWARD, down)
    for _ in range(pp - p):
        for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            emit(op, up)
    while nxt[(Op.FORWARD, up)] < nxt[(Op.FORWARD, down)] or nxt[(Op.FORWARD, down)] < n:
        if nxt[(Op.FORWARD, down)] < n:
            emit(Op.FORWARD, down)
        emit(Op.BACKWARD_INPUT, down)
        emit(Op.BACKWARD_WEIGHT, down)
        for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            emit(op, up)
    for _ in range(p):
        emit(Op.BACKWARD_INPUT, down)
        emit(Op.BACKWARD_INPUT, up)
    for _ in range(pp - p):
        emit(Op.BACKWARD_INPUT, down)
        emit(Op.BACKWARD_WEIGHT, down)
    for s in (up, down):
        while nxt[(Op.BACKWARD_WEIGHT, s)] < nxt[(Op.BACKWARD_INPUT, s)]:
            emit(Op.BACKWARD_WEIGHT, s)
    return [(op, s, mb) for op, s, mb in out if mb < m]


_ORDERS = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved-1f1b": interleaved_order,
    "fold": fold_order,
    "zb-h1": zero_bubble_order,
    "zbv": zbv_order,
    "interleaved-zb": zero_bubble_order,
    "fold-zb": fold_zb_order,
}


# --------------------------------------------------------------------------- insertion passes


def insert_comms(compute: Compute, p: int, pp: int, virtual: int, placement: str = "loop") -> list[Action]:
    """Wrap rank ``p``'s compute order with its point-to-point transfers.

    Before ``F(s)`` whose input comes from another rank: ``RECV_ACT(s, peer=rank(s-1))``;
    after ``F(s)`` whose output goes to another rank: ``SEND_ACT(s, peer=rank(s+1))``;
    before ``B(s)`` / ``I(s)`` whose output-gradient comes from another rank: ``RECV_GRAD(s, peer=rank(s+1))``;
    after ``B(s)`` / ``I(s)`` whose input-gradient goes to another rank: ``SEND_GRAD(s, peer=rank(s-1))``.
    Every id is the local segment (recvs name the consumer, sends the producer). Neighbours on the same rank
    (the V placement's turn) hand over without a transfer.
    """
    n_seg = pp * virtual
    out: list[Action] = []
    for op, s, mb in compute:
        prev_r = stage_rank(s - 1, pp, placement) if s > 0 else None
        next_r = stage_rank(s + 1, pp, placement) if s < n_seg - 1 else None
        if op is Op.FORWARD:
            if prev_r is not None and prev_r != p:
                out.append(Action(Op.RECV_ACT, s, mb, prev_r))
            out.append(Action(Op.FORWARD, s, mb))
            if next_r is not None and next_r != p:
                out.append(Action(Op.SEND_ACT, s, mb, next_r))
        elif op in BACKWARD_OPS:
            if next_r is not None and next_r != p:
                out.append(Action(Op.RECV_GRAD, s, mb, next_r))
            out.append(Action(op, s, mb))
            if prev_r is not None and prev_r != p:
                out.append(Action(Op.SEND_GRAD, s, mb, prev_r))
        else:  # W: this rank's own work, no transfer
            out.append(Action(op, s, mb))
    return out


def insert_reductions(
    actions: list[Action], dp_sync: str, defer_reduce: bool, gather_ahead: bool = False
) -> list[Action]:
    """Add LAUNCH_REDUCE / WAIT_REDUCE / OPTIM_STEP for every chunk present in ``actions``.

    A chunk's backward is finished by its last ``B`` or ``W`` (:data:`WEIGHT_OPS`).

    * ``after-flush``: at the end, ``LR(c)`` for every chunk in the order its last
      backward finished, then ``WR(c)`` for each, then ``OS(c)`` for each.
    * ``per-chunk``: ``LR(c)`` right after chunk ``c``'s last backward (and its
      ``SEND_GRAD``); at the end ``WR(c)`` for each, then ``OS(c)`` for each.
    * ``defer_reduce`` (per-chunk only): the ``WR(c)``, ``OS(c)`` of every chunk
      but the one whose forward comes first (the one the next iteration needs at
      once; fold's last to finish backward) go just before the chunk's first
      forward-related action (its ``RECV_ACT``, else its ``F``). They then wait for
      and apply the reduction launched in the PREVIOUS iteration.
    * ``gather_ahead`` (with ``defer_reduce``; the distributed optimizer, whose step starts an
      all-gather of the chunk's weights that its forward waits for): a deferred chunk's ``WR``, ``OS``
      go one chunk earlier, before the first forward-related action of the local chunk whose forwards
      come just before its own, so that all-gather runs while that chunk computes (Megatron's
      ``overlap_param_gather``, placed by the schedule).

    All ``WR`` come before all ``OS`` at the end so an executor can compute a
    global gradient norm (clipping) between them.
    """
    last_b: dict[int, int] = {}
    first_f: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.op in WEIGHT_OPS:
            last_b[a.chunk] = i
        elif a.op is Op.FORWARD:
            first_f.setdefault(a.chunk, i)
    finish_order = sorted(last_b, key=last_b.__getitem__)
    if not finish_order:
        return list(actions)

    out: list[Action] = []
    if dp_sync == "after-flush":
        out = list(actions)
        tail_chunks = finish_order
        out += [Action(Op.LAUNCH_REDUCE, c) for c in finish_order]
    else:
        # a chunk's last backward may be followed by its SEND_GRAD: launch after that.
        launch_at: dict[int, int] = {}
        for c, i in last_b.items():
            j = i
            if j + 1 < len(actions) and actions[j + 1].op is Op.SEND_GRAD and actions[j + 1].chunk == c:
                j += 1
            launch_at[j] = c
        needed_first = min(first_f, key=first_f.__getitem__)
        deferred = set(finish_order) - {needed_first} if defer_reduce else set()
        tail_chunks = [c for c in finish_order if c not in deferred]
        step_at = _deferred_steps(actions, deferred, gather_ahead)
        for i, a in enumerate(actions):
            for c in step_at.get(i, []):
                out += [Action(Op.WAIT_REDUCE, c), Action(Op.OPTIM_STEP, c)]
            out.append(a)
            if i in launch_at:
                out.append(Action(Op.LAUNCH_REDUCE, launch_at[i]))
    out += [Action(Op.WAIT_REDUCE, c) for c in tail_chunks]
    out += [Action(Op.OPTIM_STEP, c) for c in tail_chunks]
    return out


def _deferred_steps(actions: list[Action], deferred: set[int], ahead: bool) -> dict[int, list[int]]:
    """Position -> the deferred chunks whose ``WR``, ``OS`` go just before it: each chunk's first
    forward-related action (``RECV_ACT`` or ``F``), or with ``ahead`` that of the chunk whose forwards come
    before its own (see :func:`insert_reductions`)."""
    starts: list[tuple[int, int]] = []  # (first forward-related position, chunk), in order
    for i, a in enumerate(actions):
        if a.op in (Op.RECV_ACT, Op.FORWARD) and all(c != a.chunk for _, c in starts):
            starts.append((i, a.chunk))
    at: dict[int, list[int]] = {}
    for k, (i, c) in enumerate(starts):
        if c in deferred:
            at.setdefault(starts[k - 1][0] if ahead and k > 0 else i, []).append(c)
    return at


# --------------------------------------------------------------------------- entry point


def _check(name: str, pp: int, virtual: int, microbatches: int, dp_sync: str, defer_reduce: bool) -> None:
    for flag, v in (("--parallel.pp", pp), ("--parallel.virtual", virtual), ("--parallel.microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(
                f"{flag} must be a positive integer to build a pipeline schedule, got {v!r}; set it to 1 or more"
            )
    if name not in _ORDERS:
        raise ConfigError(
            f"unknown pipeline schedule {name!r}; use --parallel.schedule one of {', '.join(SCHEDULE_NAMES)}"
        )
    if dp_sync not in DP_SYNC_MODES:
        raise ConfigError(f"unknown --parallel.dp_sync {dp_sync!r}; use one of {', '.join(DP_SYNC_MODES)}")
    if name == "zbv" and virtual != 2:
        raise ConfigError(
            f"schedule zbv runs exactly two chunks per rank (its V placement) but --parallel.virtual is {virtual}; "
            "set --parallel.virtual 2, or use interleaved-zb or fold-zb for other chunk counts"
        )
    single = {"1f1b": "interleaved-1f1b or fold", "zb-h1": "interleaved-zb or fold-zb"}
    if name in single and virtual > 1:
        raise ConfigError(
            f"schedule {name} runs one chunk per rank but --parallel.virtual is {virtual}; "
            f"use {single[name]} for virtual > 1, or set --parallel.virtual 1"
        )
    if name in ("interleaved-1f1b", "interleaved-zb"):
        flat = "1f1b" if name == "interleaved-1f1b" else "zb-h1"
        if virtual < 2:
            raise ConfigError(
                f"schedule {name} needs --parallel.virtual >= 2, got {virtual}; "
                f"raise --parallel.virtual or use --parallel.schedule {flat}"
            )
        if microbatches % pp:
            lo = max(pp, microbatches - microbatches % pp)
            hi = microbatches + pp - microbatches % pp
            near = f"{lo} or {hi}" if lo != hi else f"{hi}"
            raise ConfigError(
                f"schedule {name} needs the micro-batch count to be a multiple of --parallel.pp {pp} "
                f"and at least {pp} (Megatron-LM's requirement), got {microbatches}; use {near} micro-batches "
                "(--parallel.microbatches or --train.global_batch) or --parallel.schedule fold"
            )
    if defer_reduce and name not in DEFERRABLE:
        raise ConfigError(
            f"--fold.defer_reduce only applies to --parallel.schedule fold or fold-zb, not {name}; "
            "drop it or use fold / fold-zb"
        )
    if defer_reduce and dp_sync != "per-chunk":
        raise ConfigError(
            f"--fold.defer_reduce needs --parallel.dp_sync per-chunk, got {dp_sync}; "
            f"set per-chunk or drop --fold.defer_reduce"
        )


def build_schedule(
    name: str,
    pp: int,
    virtual: int,
    microbatches: int,
    dp_sync: str = "after-flush",
    defer_reduce: bool = False,
    distributed_optimizer: bool = False,
) -> Schedule:
    """One iteration of schedule ``name`` for ``pp`` ranks x ``virtual`` chunks x ``microbatches``.

    Raises :class:`foldtrain.errors.ConfigError` for an invalid combination.
    ``defer_reduce`` with ``virtual == 1`` is accepted and changes nothing (the
    only chunk is the last to finish backward, which is never deferred). With the
    ``distributed_optimizer`` (dp > 1) deferred steps go a chunk ahead (``gather_ahead`` of
    :func:`insert_reductions`): measured, that pays only where a step starts an all-gather.
    """
    _check(name, pp, virtual, microbatches, dp_sync, defer_reduce)
    placement = placement_of(name)
    ranks = []
    for p in range(pp):
        compute = _ORDERS[name](p, pp, virtual, microbatches)
        actions = insert_comms(compute, p, pp, virtual, placement)
        ranks.append(insert_reductions(actions, dp_sync, defer_reduce, defer_reduce and distributed_optimizer))
    return Schedule(name, pp, virtual, microbatches, dp_sync, defer_reduce, ranks, placement)
