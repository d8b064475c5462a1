"""Schedule generators: gpipe, 1f1b, interleaved-1f1b and fold (Fold3D's AIAO).

Each generator only decides the ORDER OF COMPUTE on every rank (a list of
``F`` / ``B`` actions); :func:`insert_comms` and :func:`insert_reductions` then
add the point-to-point transfers and the data-parallel reduction steps the same
way for every schedule. See :mod:`.actions` for the placement and the
send / recv conventions.

Requirements on the micro-batch count ``M`` (checked by :func:`build_schedule`):

* ``gpipe``, ``1f1b``, ``fold``: any ``M >= 1``. ``1f1b`` with ``M < P`` is
  legal: rank ``p`` warms up with ``min(P - p - 1, M)`` forwards, so the early
  ranks degenerate to all-forward-then-all-backward; the pipeline is just never
  full. ``fold`` with ``M < P`` is legal too but rank 0 idles at each
  wrap-around, waiting for the last rank's previous chunk.
* ``interleaved-1f1b``: ``M`` a multiple of ``P`` (hence ``M >= P``), as in
  Megatron-LM's ``forward_backward_pipelining_with_interleaving`` whose
  chunk / micro-batch mapping works on groups of ``P`` micro-batches.
"""

from __future__ import annotations

from foldtrain.errors import ConfigError

from .actions import Action, Op, Schedule, chunks_of_rank, stage_rank

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "fold")
DP_SYNC_MODES = ("after-flush", "per-chunk")

Compute = list[tuple[Op, int, int]]  # (F or B, global segment, micro-batch)


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


def interleaved_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    Rank ``p`` runs ``T = V * M`` virtual micro-batches each way. Forward number
    ``k`` is local chunk ``(k // P) % V`` on micro-batch ``(k // (P*V)) * P + k % P``;
    backward number ``k`` the same with the chunk reversed (``V - 1 - ...``).
    Warm-up: ``min((P - p - 1) * 2 + (V - 1) * P, T)`` forwards; then
    ``F(w + k), B(k)`` pairs; then the remaining backwards.
    """
    total = virtual * m

    def fwd(k: int) -> tuple[Op, int, int]:
        c = (k // pp) % virtual
        return (Op.FORWARD, c * pp + p, (k // (pp * virtual)) * pp + k % pp)

    def bwd(k: int) -> tuple[Op, int, int]:
        c = virtual - 1 - (k // pp) % virtual
        return (Op.BACKWARD, c * pp + p, (k // (pp * virtual)) * pp + k % pp)

    warmup = min((pp - p - 1) * 2 + (virtual - 1) * pp, total)
    out: Compute = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out.append(fwd(warmup + k))
        out.append(bwd(k))
    out += [bwd(k) for k in range(total - warmup, total)]
    return out


def fold_order(p: int, pp: int, virtual: int, m: int) -> Compute:
    """Fold3D's all-in, all-out (breadth-first): forwards of chunk 0 for every mb, ...
    chunk V-1; then backwards of chunk V-1 for mb descending, ..., chunk 0."""
    segs = chunks_of_rank(p, pp, virtual)
    fwd = [(Op.FORWARD, s, mb) for s in segs for mb in range(m)]
    bwd = [(Op.BACKWARD, s, mb) for s in reversed(segs) for mb in reversed(range(m))]
    return fwd + bwd


_ORDERS = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved-1f1b": interleaved_order,
    "fold": fold_order,
}


# --------------------------------------------------------------------------- insertion passes


def insert_comms(compute: Compute, p: int, pp: int, virtual: int) -> list[Action]:
    """Wrap rank ``p``'s compute order with its point-to-point transfers.

    Before ``F(s)`` whose input comes from another rank: ``RECV_ACT(s, peer=rank(s-1))``;
    after ``F(s)`` whose output goes to another rank: ``SEND_ACT(s, peer=rank(s+1))``;
    before ``B(s)`` whose output-gradient comes from another rank: ``RECV_GRAD(s, peer=rank(s+1))``;
    after ``B(s)`` whose input-gradient goes to another rank: ``SEND_GRAD(s, peer=rank(s-1))``.
    Every id is the local segment (recvs name the consumer, sends the producer).
    """
    n_seg = pp * virtual
    out: list[Action] = []
    for op, s, mb in compute:
        prev_r = stage_rank(s - 1, pp) if s > 0 else None
        next_r = stage_rank(s + 1, pp) if s < n_seg - 1 else None
        if op is Op.FORWARD:
            if prev_r is not None and prev_r != p:
                out.append(Action(Op.RECV_ACT, s, mb, prev_r))
            out.append(Action(Op.FORWARD, s, mb))
            if next_r is not None and next_r != p:
                out.append(Action(Op.SEND_ACT, s, mb, next_r))
        else:
            if next_r is not None and next_r != p:
                out.append(Action(Op.RECV_GRAD, s, mb, next_r))
            out.append(Action(Op.BACKWARD, s, mb))
            if prev_r is not None and prev_r != p:
                out.append(Action(Op.SEND_GRAD, s, mb, prev_r))
    return out


def insert_reductions(actions: list[Action], dp_sync: str, defer_reduce: bool) -> list[Action]:
    """Add LAUNCH_REDUCE / WAIT_REDUCE / OPTIM_STEP for every chunk present in ``actions``.

    * ``after-flush``: at the end, ``LR(c)`` for every chunk in the order its last
      backward finished, then ``WR(c)`` for each, then ``OS(c)`` for each.
    * ``per-chunk``: ``LR(c)`` right after chunk ``c``'s last backward (and its
      ``SEND_GRAD``); at the end ``WR(c)`` for each, then ``OS(c)`` for each.
    * ``defer_reduce`` (per-chunk only): the ``WR(c)``, ``OS(c)`` of every chunk
      but the last to finish backward go just before the chunk's first
      forward-related action (its ``RECV_ACT``, else its ``F``). They then wait for
      and apply the reduction launched in the PREVIOUS iteration.

    All ``WR`` come before all ``OS`` at the end so an executor can compute a
    global gradient norm (clipping) between them.
    """
    last_b: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.op is Op.BACKWARD:
            last_b[a.chunk] = i
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
        deferred = set(finish_order[:-1]) if defer_reduce else set()
        tail_chunks = [c for c in finish_order if c not in deferred]
        seen_fwd: set[int] = set()
        for i, a in enumerate(actions):
            if a.op in (Op.RECV_ACT, Op.FORWARD) and a.chunk in deferred and a.chunk not in seen_fwd:
                seen_fwd.add(a.chunk)
                out += [Action(Op.WAIT_REDUCE, a.chunk), Action(Op.OPTIM_STEP, a.chunk)]
            out.append(a)
            if i in launch_at:
                out.append(Action(Op.LAUNCH_REDUCE, launch_at[i]))
    out += [Action(Op.WAIT_REDUCE, c) for c in tail_chunks]
    out += [Action(Op.OPTIM_STEP, c) for c in tail_chunks]
    return out


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
    if name == "1f1b" and virtual > 1:
        raise ConfigError(
            f"schedule 1f1b runs one chunk per rank but --parallel.virtual is {virtual}; "
            "use interleaved-1f1b or fold for virtual > 1, or set --parallel.virtual 1"
        )
    if name == "interleaved-1f1b":
        if virtual < 2:
            raise ConfigError(
                f"schedule interleaved-1f1b needs --parallel.virtual >= 2, got {virtual}; "
                "raise --parallel.virtual or use --parallel.schedule 1f1b"
            )
        if microbatches % pp:
            lo = max(pp, microbatches - microbatches % pp)
            hi = microbatches + pp - microbatches % pp
            near = f"{lo} or {hi}" if lo != hi else f"{hi}"
            raise ConfigError(
                f"schedule interleaved-1f1b needs the micro-batch count to be a multiple of --parallel.pp {pp} "
                f"and at least {pp} (Megatron-LM's requirement), got {microbatches}; use {near} micro-batches "
                "(--parallel.microbatches or --train.global_batch) or --parallel.schedule fold"
            )
    if defer_reduce and name != "fold":
        raise ConfigError(
            f"--fold.defer_reduce only applies to --parallel.schedule fold, not {name}; drop it or use fold"
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
) -> Schedule:
    """One iteration of schedule ``name`` for ``pp`` ranks x ``virtual`` chunks x ``microbatches``.

    Raises :class:`foldtrain.errors.ConfigError` for an invalid combination.
    ``defer_reduce`` with ``virtual == 1`` is accepted and changes nothing (the
    only chunk is the last to finish backward, which is never deferred).
    """
    _check(name, pp, virtual, microbatches, dp_sync, defer_reduce)
    ranks = []
    for p in range(pp):
        compute = _ORDERS[name](p, pp, virtual, microbatches)
        ranks.append(insert_reductions(insert_comms(compute, p, pp, virtual), dp_sync, defer_reduce))
    return Schedule(name, pp, virtual, microbatches, dp_sync, defer_reduce, ranks)
