"""The runtime rules of a schedule, computed once from its action lists (pure Python, no torch).

An action list says what each pipeline rank does; it does not say when a reduction is needed, what
the first iteration skips, where the iteration's global optimizer work runs, which chunks may step
early, or where the tied embedding's reduction starts. These rules follow from the lists alone, so
they are computed here once and read by both the torch executor
(:mod:`foldtrain.parallel.pipeline.executor`) and the simulator (:mod:`foldtrain.sim.events`):

* **deadline** (``LR``, ``WR``): the position of the ``WR`` that needs the chunk's reduction, counted
  in this rank's list; a deferred chunk's ``WR`` is the one before its first forward of the NEXT
  iteration, so its deadline is counted past the end of this one (``+ len(actions)``). Reductions
  go in deadline order (:mod:`foldtrain.parallel.pipeline.deadlines`).
* **deferred** (``LR``, ``WR``, ``OS``): the chunk's ``WR`` comes before its first forward
  (``--fold.defer_reduce``): its ``WR`` / ``OS`` complete the reduction launched in the previous
  iteration, so they do nothing when none is pending (the first iteration, or after a flush).
* **before_steps** (``OS``): the first non-deferred ``OS`` of the iteration, where the iteration's
  global work runs once (fp16 overflow vote, gradient norm over the pipeline, clipping).
* **step_early** (``WR`` of a non-deferred chunk): where the chunk's ``OS`` moves when the
  :class:`StepPolicy` lets a chunk step the moment its gradients land (no clipping, no loss scaler:
  nothing global has to come first); its ``OS`` then only takes part in ``before_steps``.
* **launch_tie** (an ``F`` or an ``LR``): the segment whose tied-embedding reduction
  (:mod:`foldtrain.parallel.pipeline.tie`) starts right after this action. When the pipeline splits
  the tie (``P > 1``) its two ends are segment 0 and the last segment. The last segment's fused head
  makes its copy final after its last forward, so with per-chunk sync it starts there, ahead of the
  body's backwards; otherwise (and always for segment 0) at the chunk's ``LR``, before the chunk's
  own reduction.
* **early_tie** (the iteration's end): the deferred chunks holding a tied copy, each with the deadline
  of its first forward in the next iteration (counted past this one's actions, as a deferred ``WR``'s).
  The tie's exchange needs nothing of the chunk's own reduction, so where the :class:`StepPolicy` lets
  chunks step early and the distributed optimizer slices the tied copy (over dp with ``--optim.shard_tied``,
  or in halves between the two ends, :func:`splits_tied_state`), the exchange completes once every rank has
  finished the iteration and the copy's slice steps there, alone; the all-gather of the stepped weight joins
  the deferred reductions by that deadline (over dp), or starts at once over the tie's pair (halves), instead
  of following the chunk's deferred ``OS``, right before its first forward.
* **gather_order** (the distributed optimizer's all-gathers): the rank's non-deferred chunks in the order of their
  first forward. A chunk's step starts the all-gather of its weights on the data-parallel group, whose collectives
  run in the order they were issued, and the next iteration's forwards need them in this order; the steps come in
  the order the reductions land (fold, interleaved: the last chunk first). So a chunk's all-gather starts only once
  every chunk before it in this order has stepped (:class:`GatherRelease`): the first chunk's, which is exposed
  before the next forward anyway, then goes first, and the others' overlap the forwards of the chunks before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Op, Schedule


@dataclass(frozen=True)
class StepPolicy:
    """How a run's optimizer settings change the rules (the same for the executor and the simulator)."""

    early_steps: bool = False  # a non-deferred chunk steps at its WR: nothing global has to come first
    clip: bool = False  # the iteration's gradient norm needs every reduction, deferred ones included

    @property
    def hold_deferred(self) -> bool:
        """Whether deferred buckets may wait for the urgent reductions and the iteration's end (the
        deadline queue's window): not with clipping, where every reduction lands within its iteration."""
        return not self.clip


def step_policy(clip: bool, loss_scaling: bool, tp: int) -> StepPolicy:
    """The policy of a run: early steps need no clipping, no loss scaler (no global verdict first) and
    ``tp == 1`` (a chunk's norm is then local)."""
    return StepPolicy(early_steps=not clip and not loss_scaling and tp == 1, clip=clip)


def splits_tied_state(
    policy: StepPolicy, *, dist_optim: bool, shard_tied: bool, pp: int, placement: str, defer: bool, split: bool = True
) -> bool:
    """Whether the distributed optimizer splits the tied weight's AdamW state between the pipeline's two ends: each
    end holds a copy and the whole summed gradient (the tie's exchange), steps half of the copy, and the two halves
    are all-gathered over the tie's pair (the executor's ``ChunkShards``, the simulator's ``costs``).

    Not with ``--optim.shard_tied`` (the copy sliced over dp instead), not on the V placement (both copies on one
    rank), and not where deferral could step the head's copy only in the next iteration: the embedding's first
    forward, which needs the head's half, would then wait for a step that comes after it. With deferral the head's
    half steps at the iteration's end (``early_tie``), which needs chunks that may step early (``policy``). ``split``:
    ``--optim.split_tied`` (false: never)."""
    if not split or not dist_optim or shard_tied or pp < 2 or placement == "v":
        return False
    return policy.early_steps or not defer


@dataclass(frozen=True)
class Rule:
    """What the runtime does around one action beyond the action itself (see the module docstring)."""

    deadline: int | None = None
    deferred: bool = False
    before_steps: bool = False
    step_early: bool = False
    launch_tie: int | None = None


@dataclass(frozen=True)
class RankRules:
    """One pipeline rank's actions, each with its :class:`Rule` (``rules[i]`` goes with ``actions[i]``)."""

    actions: tuple[Action, ...]
    rules: tuple[Rule, ...]
    deferred: frozenset[int]  # chunks reduced across the iteration boundary
    deadline: dict[int, int]  # chunk -> its reduction's deadline
    early_tie: dict[int, int] = field(default_factory=dict)  # deferred tied chunk -> its first forward's deadline
    gather_order: tuple[int, ...] = ()  # non-deferred chunks by first forward: their all-gathers' order

    def deadline_of(self, chunk: int) -> int:
        """The deadline of ``chunk``'s reduction (past every action when no ``WR`` needs it)."""
        return self.deadline.get(chunk, len(self.actions))

    def steps(self):
        """``(action, rule)`` pairs in order."""
        return zip(self.actions, self.rules)


def tie_segments(sched: Schedule) -> tuple[int, ...]:
    """The segments holding the tied embedding's two copies when the pipeline splits the tie."""
    return (0, sched.segments - 1) if sched.pp > 1 else ()


def rank_rules(sched: Schedule, p: int) -> RankRules:
    """The rules of pipeline rank ``p``'s actions in ``sched``."""
    actions = tuple(sched.ranks[p])
    n = len(actions)
    deferred = frozenset(sched.deferred_chunks(p))
    deadline = {a.chunk: i + (n if a.chunk in deferred else 0) for i, a in enumerate(actions) if a.op is Op.WAIT_REDUCE}
    ties = set(tie_segments(sched)) & {a.chunk for a in actions}
    tie_after = _tie_launches(actions, ties, sched.dp_sync == "per-chunk", sched.segments - 1)
    first_step = next((i for i, a in enumerate(actions) if a.op is Op.OPTIM_STEP and a.chunk not in deferred), None)
    rules = []
    for i, a in enumerate(actions):
        reduce = a.op in (Op.LAUNCH_REDUCE, Op.WAIT_REDUCE, Op.OPTIM_STEP)
        rules.append(
            Rule(
                deadline=deadline.get(a.chunk, n) if a.op in (Op.LAUNCH_REDUCE, Op.WAIT_REDUCE) else None,
                deferred=reduce and a.chunk in deferred,
                before_steps=i == first_step,
                step_early=a.op is Op.WAIT_REDUCE and a.chunk not in deferred,
                launch_tie=tie_after.get(i),
            )
        )
    first_forward = {a.chunk: i + n for i, a in reversed(list(enumerate(actions))) if a.op is Op.FORWARD}
    stepped = {a.chunk for a in actions if a.op is Op.OPTIM_STEP} - deferred
    order = tuple(sorted(stepped, key=lambda c: first_forward.get(c, 2 * n)))
    return RankRules(actions, tuple(rules), deferred, deadline, {c: first_forward[c] for c in deferred & ties}, order)


@dataclass
class GatherRelease:
    """One iteration's :attr:`RankRules.gather_order` at work: which chunks' all-gathers start when a chunk steps."""

    order: tuple[int, ...]
    stepped: set[int] = field(default_factory=set)
    released: int = 0  # how many of ``order`` have started their all-gathers

    def holds(self, chunk: int) -> bool:
        """Whether ``chunk``'s step leaves its all-gather to :meth:`step` (a non-deferred chunk's)."""
        return chunk in self.order

    def step(self, chunk: int) -> list[int]:
        """``chunk`` stepped: the chunks whose all-gathers start now, in order (none while one before it has not
        stepped)."""
        if not self.holds(chunk):
            return [chunk]
        self.stepped.add(chunk)
        start = self.released
        while self.released < len(self.order) and self.order[self.released] in self.stepped:
            self.released += 1
        return list(self.order[start : self.released])


def _tie_launches(actions: tuple[Action, ...], ties: set[int], per_chunk: bool, last: int) -> dict[int, int]:
    """Action index -> the tied segment whose reduction starts right after it."""
    out = {}
    for s in ties:
        if per_chunk and s == last:
            i = max((i for i, a in enumerate(actions) if a.op is Op.FORWARD and a.chunk == s), default=None)
        else:
            i = next((i for i, a in enumerate(actions) if a.op is Op.LAUNCH_REDUCE and a.chunk == s), None)
        if i is not None:
            out[i] = s
    return out


def schedule_rules(sched: Schedule) -> list[RankRules]:
    """:func:`rank_rules` of every pipeline rank."""
    return [rank_rules(sched, p) for p in range(sched.pp)]
