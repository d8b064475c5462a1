"""The action vocabulary of a pipeline schedule (pure Python, no torch).

A schedule is one list of :class:`Action` per pipeline rank, for ONE training
iteration. The same lists drive the torch executor, the simulator and the
timeline plots.

Placement: the model is cut into ``S = P * V`` segments. ``"loop"`` (folded, as
Megatron's interleaved schedule and Fold3D, every schedule but zbv): segment ``s``
lives on rank ``s % P`` as that rank's local chunk ``s // P``; the chain of
segments wraps around the ring of ranks ``V`` times, rank ``P-1`` sending the
output of segment ``c*P + P-1`` to rank 0's segment ``(c+1)*P``. ``"v"`` (ZB-V,
``V = 2``): rank ``p`` holds segments ``p`` and ``2P-1-p``; the chain runs down
the ranks and back up, so rank ``P-1`` hands segment ``P-1``'s output to its own
segment ``P`` without a transfer, and rank 0 holds both the first and the last
segment (the tied embedding's two ends).

``Action.chunk`` is always the GLOBAL segment id, and it is always a segment
that lives on the rank whose list holds the action:

* ``SEND_ACT(s, m, peer)``  -- after ``F(s, m)``: send the output of segment
  ``s`` (the PRODUCER, local) to ``peer = stage_rank(s + 1)``.
* ``RECV_ACT(s, m, peer)``  -- before ``F(s, m)``: receive the input of
  segment ``s`` (the CONSUMER, local) from ``peer = stage_rank(s - 1)``.
  ``SEND_ACT(s, m)`` on rank(s) is matched by ``RECV_ACT(s + 1, m)`` on rank(s+1).
* ``SEND_GRAD(s, m, peer)`` -- after ``B(s, m)``: send the gradient w.r.t. the
  input of segment ``s`` (the PRODUCER, local) to ``peer = stage_rank(s - 1)``.
* ``RECV_GRAD(s, m, peer)`` -- before ``B(s, m)``: receive the gradient w.r.t.
  the output of segment ``s`` (the CONSUMER, local) from ``peer = stage_rank(s + 1)``.
  ``SEND_GRAD(s, m)`` on rank(s) is matched by ``RECV_GRAD(s - 1, m)`` on rank(s-1).

:func:`message_key` maps both ends of a transfer to the same key
``(kind, producing segment, mb)``.

Split backward (zero-bubble schedules, Qi et al. 2024): a micro-batch's backward of segment ``s`` is
either one ``B(s, m)`` or an ``I(s, m)`` (the gradient w.r.t. the segment's input: what ``SEND_GRAD``
sends upstream) followed, any time later on the same rank, by a ``W(s, m)`` (the weights' gradients).
``W`` needs no other rank, so a schedule may place it in what would be a bubble. Activations live
until the ``W`` (or ``B``). ``BACKWARD_OPS`` produce the input gradient, ``WEIGHT_OPS`` complete the
weights' gradients (a chunk's ``LAUNCH_REDUCE`` waits for one per micro-batch).

``LAUNCH_REDUCE(c)``, ``WAIT_REDUCE(c)``, ``OPTIM_STEP(c)`` act on the
data-parallel gradient reduction and the optimizer step of local chunk
(segment) ``c``; their ``mb`` and ``peer`` are ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    LAUNCH_REDUCE = "LR"
    WAIT_REDUCE = "WR"
    OPTIM_STEP = "OS"

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
BACKWARD_OPS = frozenset({Op.BACKWARD, Op.BACKWARD_INPUT})  # produce the gradient w.r.t. the segment's input
WEIGHT_OPS = frozenset({Op.BACKWARD, Op.BACKWARD_WEIGHT})  # complete the micro-batch's weight gradients
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
COMM_OPS = SEND_OPS | RECV_OPS
REDUCE_OPS = frozenset({Op.LAUNCH_REDUCE, Op.WAIT_REDUCE, Op.OPTIM_STEP})


def runs_backward(op: Op, segment: int) -> bool:
    """Whether ``op`` on ``segment`` is the autograd pass through the segment's blocks: a ``B``; of a split
    backward the ``I``, but segment 0's ``W``: its input is the token ids, which take no gradient, so its ``I``
    computes nothing and its ``W`` is its whole backward (as torch pipelining runs its first stage)."""
    if op is Op.BACKWARD_INPUT:
        return segment > 0
    if op is Op.BACKWARD_WEIGHT:
        return segment == 0
    return op is Op.BACKWARD


@dataclass(frozen=True)
class Action:
    op: Op
    chunk: int  # global segment id, local to the rank holding the action
    mb: int | None = None  # micro-batch; None for LR / WR / OS
    peer: int | None = None  # pipeline rank on the other side of a send / recv

    def __str__(self) -> str:
        if self.mb is None:
            return f"{self.op.value}(c{self.chunk})"
        if self.peer is None:
            return f"{self.op.value}(c{self.chunk},m{self.mb})"
        arrow = "->" if self.op in SEND_OPS else "<-"
        return f"{self.op.value}(c{self.chunk},m{self.mb}{arrow}{self.peer})"


def stage_rank(s: int, pp: int, placement: str = "loop") -> int:
    """Pipeline rank that holds global segment ``s``."""
    if placement == "v":
        return s if s < pp else 2 * pp - 1 - s
    return s % pp


def local_chunk(s: int, pp: int) -> int:
    """Index of segment ``s`` among its rank's chunks (0 = earliest in the model), in either placement."""
    return s // pp


def chunks_of_rank(p: int, pp: int, virtual: int, placement: str = "loop") -> list[int]:
    """Global segment ids held by rank ``p``, ascending."""
    if placement == "v":
        return [p, 2 * pp - 1 - p]
    return [c * pp + p for c in range(virtual)]


def message_key(a: Action) -> tuple[str, int, int]:
    """The transfer a send or recv takes part in: (kind, producing segment, mb).

    ``SA(s, m)`` and ``RA(s + 1, m)`` share key ``("act", s, m)``;
    ``SG(s, m)`` and ``RG(s - 1, m)`` share key ``("grad", s, m)``.
    """
    if a.mb is None:
        raise ValueError(f"{a} is not a send or recv")
    if a.op is Op.SEND_ACT:
        return ("act", a.chunk, a.mb)
    if a.op is Op.RECV_ACT:
        return ("act", a.chunk - 1, a.mb)
    if a.op is Op.SEND_GRAD:
        return ("grad", a.chunk, a.mb)
    if a.op is Op.RECV_GRAD:
        return ("grad", a.chunk + 1, a.mb)
    raise ValueError(f"{a} is not a send or recv")


@dataclass
class Schedule:
    """One training iteration: ``ranks[p]`` is pipeline rank ``p``'s action list.

    With ``defer_reduce`` the ``WAIT_REDUCE(c)`` / ``OPTIM_STEP(c)`` that sit
    before chunk ``c``'s first forward (see :meth:`deferred_chunks`) refer to
    the reduction LAUNCHED IN THE PREVIOUS ITERATION: the executor skips them in
    the first iteration and must run the pending ones (wait + step) at the end
    of training and before every checkpoint or evaluation that reads weights.
    """

    name: str
    pp: int
    virtual: int
    microbatches: int
    dp_sync: str
    defer_reduce: bool
    ranks: list[list[Action]] = field(default_factory=list)
    placement: str = "loop"  # which rank holds which segment (module docstring)

    @property
    def segments(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, s: int) -> int:
        """Pipeline rank that holds segment ``s``."""
        return stage_rank(s, self.pp, self.placement)

    def chunks_of(self, p: int) -> list[int]:
        """Segments held by rank ``p``, ascending."""
        return chunks_of_rank(p, self.pp, self.virtual, self.placement)

    def compute_only(self, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions (F, B, I, W), in order."""
        return [a for a in self.ranks[rank] if a.op in COMPUTE_OPS]

    def deferred_chunks(self, rank: int) -> list[int]:
        """Chunks whose WAIT_REDUCE comes before their first forward (previous iteration's reduction)."""
        first_f: dict[int, int] = {}
        wait: dict[int, int] = {}
        for i, a in enumerate(self.ranks[rank]):
            if a.op is Op.FORWARD:
                first_f.setdefault(a.chunk, i)
            elif a.op is Op.WAIT_REDUCE:
                wait.setdefault(a.chunk, i)
        return sorted(c for c, i in wait.items() if c in first_f and i < first_f[c])


def format_schedule(sched: Schedule, *, all_actions: bool = False) -> str:
    """Each rank's compute actions (or every action) on one line."""
    head = (
        f"{sched.name}: pp={sched.pp} virtual={sched.virtual} microbatches={sched.microbatches} "
        f"dp_sync={sched.dp_sync}"
        + (" defer_reduce" if sched.defer_reduce else "")
        + (f" placement={sched.placement}" if sched.placement != "loop" else "")
    )
    width = len(str(max(sched.pp - 1, 0)))
    lines = [head]
    for p in range(sched.pp):
        acts = sched.ranks[p] if all_actions else sched.compute_only(p)
        lines.append(f"rank {p:>{width}}: " + " ".join(str(a) for a in acts))
    return "\n".join(lines)
