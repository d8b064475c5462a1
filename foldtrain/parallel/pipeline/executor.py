"""One executor for every pipeline schedule: it runs a rank's action list for one iteration.

Schedules are data (:mod:`foldtrain.schedules`); the rules around their actions (deadlines, what
the first iteration skips, where the iteration's global work runs, early steps, where the tie's
reduction starts) come from :mod:`foldtrain.schedules.rules`, which the simulator reads too. This
module gives each action its meaning, one handler per op:

* ``F(s, m)``  forward of local segment ``s`` on micro-batch ``m``. Segment 0 takes the tokens;
  any other segment the activation ``RA`` received, as a leaf with ``requires_grad`` (its ``.grad``
  is what ``SG`` sends back), or, where the previous segment is on this rank too (the V placement's
  turn), that segment's output, handed over as if sent (and its input's gradient handed back to it).
  The LAST segment fuses its head: it runs the body, then the head and
  the loss on the detached hidden state and immediately their backward, frees the logits and keeps
  only ``d loss / d hidden`` for its ``B`` (Fold3D's fused head: the last rank can start backward
  right after its last forward, and never holds more than one micro-batch's logits).
* ``B(s, m)``  backward of the stored output with the received (or fused-head) gradient.
* ``I(s, m)`` / ``W(s, m)``  the same backward in two parts (:mod:`.split_backward`): ``I`` the
  input's gradient (what ``SG`` sends), ``W`` later the weights' gradients; the graph lives until the ``W``.
* ``SA`` / ``SG``  ``isend`` of the output / input gradient; NEVER waited on before the end of the
  iteration, so a send cannot block the executor (the interleaved and fold schedules deadlock
  when sends rendezvous with receives: see ``foldtrain/schedules/validate.py``).
* ``RA`` / ``RG``  ``irecv`` into a buffer of the known shape ``(rows, seq, d_model)``, then a
  wait bounded by ``--dp.timeout_s``: a peer that stalls or dies turns into a
  :class:`~foldtrain.errors.DistributedError` naming it and the transfer.
* ``LR(c)`` launches chunk ``c``'s data-parallel gradient all-reduce (averaged over dp)
  asynchronously, with its deadline. Urgent (same-iteration) reductions are issued at once;
  deferred ones in buckets, in deadline order, never ahead of an urgent one (:mod:`.deadlines`; the
  ``--profile`` trace shows each bucket as a ``reduce`` event with its deadline and issue order).
* ``WR(c)`` waits and unpacks; ``OS(c)`` steps the chunk's own optimizer and LR schedule
  (:class:`ChunkStepper`). Gradient clipping (global norm over every chunk, pipeline rank and TP
  rank) and the fp16 overflow check run once, at the first non-deferred ``OS``, when all ``WR``
  are done. With the :class:`~foldtrain.schedules.StepPolicy`'s ``early_steps`` (no clipping, no
  loss scaler) a chunk steps at its ``WR`` instead, while later reductions are still in flight.
* A deferred chunk's ``WR(c)`` / ``OS(c)`` (``--fold.defer_reduce``) complete the reduction
  launched in the PREVIOUS iteration and do nothing when none is pending; :meth:`Executor.flush`
  completes the pending ones (end of training, checkpoints, evaluation).
* The tied embedding's two copies (segment 0 and the last segment) are reduced over dp by each end
  where the rules launch them, then exchanged between the two ends (:mod:`.tie`): each end hands
  over the moment its dp reduction lands (polled after every action), at the latest before its
  next ``WR`` / ``OS`` or the end of the iteration; the embedding end's token ids are
  all-gathered when the iteration starts.

Transport (:mod:`.p2p`), the per-chunk reductions (:mod:`.reducer`) and the tie (:mod:`.tie`) live
beside this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from foldtrain.parallel.pipeline import split_backward
from foldtrain.parallel.pipeline.deadlines import DeadlineQueue
from foldtrain.parallel.pipeline.p2p import P2P
from foldtrain.schedules import (
    Action,
    GatherRelease,
    Op,
    RankRules,
    Rule,
    Schedule,
    StepPolicy,
    rank_rules,
    stage_rank,
)

ACT, GRAD, EVAL_ACT = 0, 1, 2


class ChunkStepper(Protocol):
    """The optimizer side of a pipeline rank, as the executor drives it."""

    def step(self, s: int, hold_gather: bool = False) -> None:
        """``OS(s)``: local chunk ``s``'s optimizer and LR-schedule step. ``hold_gather``: the all-gather of its
        weights over dp (the distributed optimizer's) waits for :meth:`start_gathers`."""

    def step_early(self, s: int, hold_gather: bool = False) -> None:
        """``step`` at the chunk's ``WR``, keeping what the iteration's gradient norm needs of it."""

    def start_gathers(self, s: int) -> None:
        """Start the all-gathers chunk ``s``'s step held (the rules' ``gather_order``)."""

    def before_steps(self) -> None:
        """Once per iteration, before the first non-deferred step: overflow check, gradient norm, clip."""

    def steps_tied_apart(self, s: int) -> bool:
        """Whether chunk ``s``'s copy of the tied weight can step apart from the chunk (the distributed optimizer
        slices it, over dp with ``--optim.shard_tied`` or between the pipeline's ends, and nothing global comes
        before a step)."""

    def step_tied(self, s: int, queue: DeadlineQueue, deadline: int) -> None:
        """Step only chunk ``s``'s slice of the tied copy, whose gradient is final, and start its all-gather: over dp
        it joins ``queue``'s deferred buckets with ``deadline``; between the ends it starts at once, on the pair's
        link (where :meth:`steps_tied_apart`)."""

    def start_rows(self, s: int, ids: list[torch.Tensor]) -> torch.Tensor | None:
        """When the iteration starts: where chunk ``s`` only looks its weight's rows up and its last step still owes
        them (``--optim.shard_tied``'s embedding copy), start landing the rows of the step's token ids ``ids`` over
        every dp rank; returns those ranks' ids (all-gathered), else None."""

    def gathering(self, s: int, ids: list[torch.Tensor] | None = None) -> bool:
        """Whether :meth:`weights_ready` has anything to wait for."""

    def weights_ready(self, s: int, ids: list[torch.Tensor] | None = None) -> None:
        """Before chunk ``s``'s weights are read: what its last step still sends them (the distributed
        optimizer's all-gather) has landed. ``ids``: the step's token ids, when the reader is the first chunk's
        training forward (an embedding looks up only their rows)."""


@dataclass
class Iteration:
    """One training iteration's tensors on this rank, keyed by ``(segment, micro-batch)``."""

    rules: RankRules  # this rank's actions with their runtime rules
    xs: list[torch.Tensor]  # token ids of each micro-batch
    ys: list[torch.Tensor]  # their targets
    loss_sum: torch.Tensor  # sum of the micro-batch losses / M (the last segment's rank only)
    received_acts: dict = field(default_factory=dict)  # RA -> F: the previous stage's outputs
    stage_inputs: dict = field(default_factory=dict)  # F -> B: each forward's input (its .grad goes back)
    stage_outputs: dict = field(default_factory=dict)  # F -> SA, B: each forward's output
    received_grads: dict = field(default_factory=dict)  # RG -> B: gradients w.r.t. those outputs
    input_grads: dict = field(default_factory=dict)  # B / I -> SG: gradients w.r.t. each forward's input
    weight_work: dict = field(default_factory=dict)  # I -> W: what the weights' gradients still need
    forward_notes: dict = field(default_factory=dict)  # F -> I: what a split backward noted of the forward
    split: bool = False  # the schedule splits backwards into I and W
    sends: list = field(default_factory=list)  # (work, tensor, action): posted, waited at the end
    stepped_early: set = field(default_factory=set)  # chunks a WR stepped (their OS only meets the norm)
    gathers: GatherRelease | None = None  # which steps start which all-gathers (the rules' gather_order)

    def __post_init__(self) -> None:
        self.gathers = GatherRelease(self.rules.gather_order)

    @property
    def n_mb(self) -> int:
        return len(self.xs)

    def leftover(self) -> list:
        held = (
            self.received_acts,
            self.stage_inputs,
            self.stage_outputs,
            self.received_grads,
            self.input_grads,
            self.weight_work,
            self.forward_notes,
        )
        return [k for d in held for k in d]


class Executor:
    """Runs one pipeline rank's action list per iteration over its chunks."""

    def __init__(
        self,
        *,
        chunks: dict,  # global segment -> Chunk
        n_segments: int,
        topo,
        p2p: P2P,
        reducers: dict,  # global segment -> ChunkReducer
        stepper: ChunkStepper,
        policy: StepPolicy,
        queue: DeadlineQueue | None,  # deadline-ordered data-parallel reductions (dp > 1)
        precision,
        loss_fn: Callable,
        act_dtype: torch.dtype,
        d_model: int,
        timeline,
        sync: Callable[[], None] | None = None,
        rank_of: Callable[[int], int] | None = None,  # segment -> pipeline rank (the schedules' placement)
        gather_for_backward: Callable | None = None,  # a sharded chunk's gather before an I (fsdp.unshard)
    ):
        self.chunks = chunks
        self.n_seg = n_segments
        self.last = n_segments - 1
        self.pp = topo.pp
        self.p = topo.pp_rank
        self.tp = topo.tp
        self.p2p = p2p
        self.reducers = reducers
        self.stepper = stepper
        self.policy = policy
        self.queue = queue
        self.precision = precision
        self.loss_fn = loss_fn
        self.act_dtype = act_dtype
        self.d_model = d_model
        self.tl = timeline
        self.sync = sync or (lambda: None)
        self.rank_of = rank_of or (lambda s: stage_rank(s, self.pp))
        self.gather_for_backward = gather_for_backward
        self.awaiting_step: set[int] = set()  # chunks whose reduction was launched, not yet stepped
        self._rules: tuple[Schedule, RankRules] | None = None
        self._splits: dict = {}  # segment -> its split backward (zero-bubble schedules)
        self._ties = [r for r in reducers.values() if r.tie is not None]
        self._handlers = {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.SEND_ACT: self._send,
            Op.SEND_GRAD: self._send,
            Op.RECV_ACT: self._recv,
            Op.RECV_GRAD: self._recv,
            Op.LAUNCH_REDUCE: self._launch_reduce,
            Op.WAIT_REDUCE: self._wait_reduce,
            Op.OPTIM_STEP: self._optim_step,
        }

    def rules(self, sched: Schedule) -> RankRules:
        """This rank's rules of ``sched`` (computed once per schedule)."""
        if self._rules is None or self._rules[0] is not sched:
            self._rules = (sched, rank_rules(sched, self.p))
        return self._rules[1]

    def complete_reductions(self) -> None:
        """Wait for every launched reduction, deferred ones included (a global norm needs them all)."""
        for s in sorted(self.reducers):
            with self._span(f"WR c{s}", "reduce_wait", chunk=s, for_norm=True):
                self.reducers[s].wait()

    # ------------------------------------------------------------------ helpers
    def _handoff(self) -> None:
        """Hand the tied embedding's dp-reduced copy to the other end (:mod:`.tie`) before anything
        that may wait on that end: a ``WR``, an ``OS`` (its global collectives) or the end of the
        iteration. A no-op where nothing is waiting to be handed off."""
        for r in self._ties:
            r.handoff()

    def _between_actions(self) -> None:
        """Issue the next deferred bucket and hand over the tie's copy if their time has come."""
        if self.queue is not None:
            self.queue.pump()
        for r in self._ties:
            r.progress()

    def _span(self, name: str, kind: str, **args):
        return self.tl.span(name, kind, **args)

    def _shape(self, it: Iteration, m: int) -> tuple[int, int, int]:
        return (it.xs[m].shape[0], it.xs[m].shape[1], self.d_model)

    def _launch_tie(self, s: int, deadline: int) -> None:
        with self._span(f"tie c{s}", "reduce_launch", chunk=s, tie=True, deadline=deadline):
            self.reducers[s].launch_tie(deadline)

    # ------------------------------------------------------------------ one training iteration
    def run(self, sched: Schedule, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
        """Run this rank's actions of ``sched`` on micro-batches ``xs`` / ``ys``; returns the sum of the
        micro-batch losses divided by M (the rank's mean loss; zero unless it holds the last segment)."""
        rules = self.rules(sched)
        it = Iteration(rules, xs, ys, torch.zeros((), dtype=torch.float32, device=xs[0].device))
        it.split = any(a.op is Op.BACKWARD_INPUT for a in rules.actions)  # the forwards note what the W needs
        # the embedding's rows first: they travel ahead of the all-gathers of the chunks stepping before its forward
        every = self.stepper.start_rows(0, xs) if 0 in self.chunks else None
        for r in self.reducers.values():
            r.begin(xs, every)
        for a, rule in rules.steps():
            self._between_actions()
            self._handlers[a.op](it, a, rule)
        self._handoff()
        for work, _t, a in it.sends:
            kind = "activations" if a.op is Op.SEND_ACT else "gradients"
            what = f"its receive of the {kind} of chunk {a.chunk} microbatch {a.mb} (send completion)"
            self.p2p.wait(work, what, a.peer)
        if it.leftover():  # pragma: no cover - validated schedules consume everything they produce
            raise RuntimeError(f"pipeline rank {self.p}: schedule left unfinished work {it.leftover()[:4]}")
        return it.loss_sum

    def _forward(self, it: Iteration, a: Action, rule: Rule) -> None:
        s, m = a.chunk, a.mb
        chunk = self.chunks[s]
        if s == 0:
            inp = it.xs[m]
        elif self._local(s - 1):  # as if sent: a leaf of the transfer's dtype
            inp = it.stage_outputs[(s - 1, m)].detach().to(self.act_dtype).requires_grad_(True)
        else:
            inp = it.received_acts.pop((s, m)).requires_grad_(True)
        ids = it.xs if s == 0 else None
        if self.stepper.gathering(s, ids):  # (a span only where it waits: the simulator's "AG" event)
            with self._span(f"AG c{s}", "reduce_wait", chunk=s, gather=True):
                self.stepper.weights_ready(s, ids)
        with self._span(f"F c{s} m{m}", "compute", op="F", chunk=s, mb=m):
            with self.precision.forward_context():
                run = chunk.body if s == self.last else chunk
                if it.split:  # what the split backward's W needs of this forward
                    out, it.forward_notes[(s, m)] = self._split(s).forward(run, inp)
                else:
                    out = run(inp)
            if s == self.last:
                out = (out, self._fused_head(it, chunk, out, m))
            self.sync()
        it.stage_inputs[(s, m)] = inp
        it.stage_outputs[(s, m)] = out
        if rule.launch_tie is not None:
            self._launch_tie(rule.launch_tie, it.rules.deadline_of(rule.launch_tie))

    def _fused_head(self, it: Iteration, chunk, hidden: torch.Tensor, m: int) -> torch.Tensor:
        """The head and the loss on the detached hidden state, forward and backward at once; returns
        ``d loss / d hidden`` for the segment's ``B``."""
        hd = hidden.detach().requires_grad_(True)
        with self.precision.forward_context():
            loss = self.loss_fn(chunk.head(hd), it.ys[m]) / it.n_mb
        self.precision.scaler.loss(loss).backward()
        it.loss_sum += loss.detach().float()
        return hd.grad

    def _backward(self, it: Iteration, a: Action, rule: Rule) -> None:
        s, m = a.chunk, a.mb
        outputs, grads = self._output_grads(it, s, m)
        inp = it.stage_inputs.pop((s, m))
        with self._span(f"B c{s} m{m}", "compute", op="B", chunk=s, mb=m):
            torch.autograd.backward(outputs, grads)
            self.sync()
        del outputs, grads
        if s > 0:
            it.input_grads[(s, m)] = inp.grad

    def _output_grads(self, it: Iteration, s: int, m: int) -> tuple[list, list]:
        """The stored output of ``F(s, m)`` and the gradient its backward starts from."""
        out = it.stage_outputs.pop((s, m))
        if s == self.last:
            return [out[0]], [out[1]]
        if self._local(s + 1):  # the next segment's input gradient, as if sent
            return [out], [it.input_grads.pop((s + 1, m)).to(self.act_dtype)]
        return [out], [it.received_grads.pop((s, m))]

    def _local(self, s: int) -> bool:
        """Whether segment ``s`` is on this rank (a neighbour handed over without a transfer)."""
        return self.rank_of(s) == self.p

    def _split(self, s: int):
        """Chunk ``s``'s split backward (:mod:`.split_backward`), made on first use."""
        if s not in self._splits:
            chunk = self.chunks[s]
            recomputed = any(getattr(m, "_foldtrain_ac", False) for m in chunk.modules())
            self._splits[s] = split_backward.split_for(chunk, recomputed, self.gather_for_backward, self.tp > 1)
        return self._splits[s]

    def _backward_input(self, it: Iteration, a: Action, rule: Rule) -> None:
        s, m = a.chunk, a.mb
        outputs, grads = self._output_grads(it, s, m)
        inp = it.stage_inputs.pop((s, m))
        notes = it.forward_notes.pop((s, m))
        with self._span(f"I c{s} m{m}", "compute", op="I", chunk=s, mb=m):
            it.weight_work[(s, m)] = split_backward.backward_input(self._split(s), outputs, grads, inp, notes)
            self.sync()
        if s > 0:
            it.input_grads[(s, m)] = inp.grad

    def _backward_weight(self, it: Iteration, a: Action, rule: Rule) -> None:
        s, m = a.chunk, a.mb
        work = it.weight_work.pop((s, m))
        with self._span(f"W c{s} m{m}", "compute", op="W", chunk=s, mb=m):
            split_backward.backward_weight(self._split(s), work)
            self.sync()

    def _send(self, it: Iteration, a: Action, rule: Rule) -> None:
        s, m = a.chunk, a.mb
        if a.op is Op.SEND_ACT:
            t, kind = it.stage_outputs[(s, m)].detach(), ACT
        else:
            t, kind = it.input_grads.pop((s, m)), GRAD
        t = t.to(self.act_dtype).contiguous()
        with self._span(f"{a.op.value} c{s} m{m}", "send", chunk=s, mb=m, peer=a.peer):
            work = self.p2p.isend(t, a.peer, self.p2p.tag(kind, s, m, self.n_seg, it.n_mb), kind == GRAD)
        it.sends.append((work, t, a))

    def _recv(self, it: Iteration, a: Action, rule: Rule) -> None:
        s, m = a.chunk, a.mb
        if a.op is Op.RECV_ACT:
            kind, producer, into, what = ACT, s - 1, it.received_acts, "activations"
        else:
            kind, producer, into, what = GRAD, s + 1, it.received_grads, "gradients"
        tag = self.p2p.tag(kind, producer, m, self.n_seg, it.n_mb)
        with self._span(f"{a.op.value} c{s} m{m}", "recv_wait", chunk=s, mb=m, peer=a.peer):
            into[(s, m)] = self.p2p.recv(
                self._shape(it, m), self.act_dtype, a.peer, tag, f"{what} of chunk {s} microbatch {m}", kind == GRAD
            )

    def _launch_reduce(self, it: Iteration, a: Action, rule: Rule) -> None:
        s = a.chunk
        if rule.launch_tie is not None:  # first: the other end waits for it, the chunk's buckets only this rank
            self._launch_tie(rule.launch_tie, rule.deadline)
        with self._span(f"LR c{s}", "reduce_launch", chunk=s, deadline=rule.deadline, deferred=rule.deferred):
            self.reducers[s].launch(rule.deadline, rule.deferred)
        self.awaiting_step.add(s)

    def _wait_reduce(self, it: Iteration, a: Action, rule: Rule) -> None:
        s = a.chunk
        self._handoff()
        if rule.deferred and not self.reducers[s].pending:
            return  # nothing was launched in the previous iteration (the first one, or flushed)
        with self._span(f"WR c{s}", "reduce_wait", chunk=s, deferred=rule.deferred):
            self.reducers[s].wait()
        if rule.step_early and self.policy.early_steps:
            with self._span(f"OS c{s}", "optim", chunk=s, early=True):
                self.stepper.step_early(s, hold_gather=True)
                self._start_gathers(it, s)
            it.stepped_early.add(s)

    def _optim_step(self, it: Iteration, a: Action, rule: Rule) -> None:
        s = a.chunk
        self._handoff()
        if rule.deferred:
            if s in self.awaiting_step:
                with self._span(f"OS c{s}", "optim", chunk=s, deferred=True):
                    self.stepper.step(s)
                self.awaiting_step.discard(s)
            return
        if rule.before_steps:
            with self._span("clip", "optim"):
                if self.policy.clip and it.rules.deferred:  # the norm needs this iteration's deferred reductions
                    self.complete_reductions()  # (their steps stay before their next forward)
                self.stepper.before_steps()
        if s not in it.stepped_early:
            with self._span(f"OS c{s}", "optim", chunk=s):
                self.stepper.step(s, hold_gather=True)
                self._start_gathers(it, s)
        self.awaiting_step.discard(s)

    def _start_gathers(self, it: Iteration, s: int) -> None:
        """Chunk ``s`` stepped, its all-gathers held: those that start now, in the rules' ``gather_order`` (its own at
        once where it is not in the order), as the simulator's ``_launch_gather``."""
        for c in it.gathers.step(s):
            self.stepper.start_gathers(c)

    # ------------------------------------------------------------------ between iterations
    def deferred_count(self) -> int | None:
        """What :meth:`end_iteration` agrees on over dp (:meth:`DeadlineQueue.count`), or None: nothing deferred."""
        return self.queue.count() if self.queue is not None else None

    def end_iteration(self, agreed: int | None) -> None:
        """After every rank finished the iteration (the engine calls it after the loss all-reduce):
        the deferred buckets still held back are issued (:meth:`DeadlineQueue.end_iteration`); ``agreed``: the
        data-parallel group's largest :meth:`deferred_count`, carried by the loss's all-gather (None: nothing
        deferred).

        Not at the end of :meth:`run`: a rank that finishes early (the head's, whose last reduction
        is small) would then put its deferred buckets on the node's link while another rank of the
        node still waits for its urgent reduction (chunk 0's, the step's critical path); measured on
        the 1 Gbit/s bench, fold + deferral V = 4, that cost 13% of the throughput."""
        if self._rules is not None:
            self._step_ties_early(self._rules[1])
        if self.queue is not None:
            self.queue.end_iteration(agreed)

    def _step_ties_early(self, rules: RankRules) -> None:
        """``early_tie``: a deferred chunk's tied copy, exchanged with the other end (every rank has finished the
        iteration, so the other end has sent its part), steps its slice (or half) now; its all-gather joins the
        deferred buckets in deadline order (the chunk's first forward of the next iteration) over dp, or starts at
        once on the tie's pair (halves)."""
        if not self.policy.early_steps or self.queue is None:
            return
        for s, deadline in sorted(rules.early_tie.items()):
            tie = self.reducers[s].tie
            # (no trace span: the iteration's window is closed, and the next has not opened)
            if self.stepper.steps_tied_apart(s) and tie is not None and tie.state != "idle":  # (idle: after a flush)
                tie.wait()
                self.stepper.step_tied(s, self.queue, deadline)

    def reset(self) -> None:
        """Drop every pending deferred reduction and step (before loading a checkpoint)."""
        self.awaiting_step.clear()
        for r in self.reducers.values():
            r.reset()
        for s in self.chunks:
            self.stepper.weights_ready(s)

    def flush(self) -> None:
        """Complete every deferred reduction and optimizer step (before reading or saving weights)."""
        for s in sorted(self.awaiting_step):
            with self._span(f"WR c{s}", "reduce_wait", chunk=s, flush=True):
                self.reducers[s].wait()
            with self._span(f"OS c{s}", "optim", chunk=s, flush=True):
                self.stepper.step(s)
        self.awaiting_step.clear()
        for s in self.chunks:
            self.stepper.weights_ready(s)

    # ------------------------------------------------------------------ forward only (evaluation)
    @torch.no_grad()
    def forward_only(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """Loss of every micro-batch (on the rank holding the last segment; empty elsewhere).

        Order: each local segment in model order, all micro-batches (breadth-first): deadlock-free
        with non-blocking sends because every receive depends only on lower segments.
        """
        n_mb = len(xs)
        losses: list[torch.Tensor] = []
        sends: list = []
        local: dict = {}  # outputs handed to the next segment on this rank
        for s in sorted(self.chunks):
            self.stepper.weights_ready(s)
            for m in range(n_mb):
                inp = xs[m] if s == 0 else local.pop((s - 1, m), None)
                inp = self._recv_eval(xs, s, m) if inp is None else inp
                with self.precision.forward_context():
                    out = self.chunks[s](inp)
                    if s == self.last:
                        losses.append(self.loss_fn(out, ys[m]).float())
                        continue
                t = out.to(self.act_dtype).contiguous()
                if self._local(s + 1):
                    local[(s, m)] = t
                    continue
                tag = self.p2p.tag(EVAL_ACT, s, m, self.n_seg, n_mb)
                sends.append((self.p2p.isend(t, self.rank_of(s + 1), tag), t, s, m))
        for work, _t, s, m in sends:
            what = f"its receive of evaluation activations of chunk {s + 1} microbatch {m}"
            self.p2p.wait(work, what, self.rank_of(s + 1))
        return losses

    def _recv_eval(self, xs: list[torch.Tensor], s: int, m: int) -> torch.Tensor:
        shape = (xs[m].shape[0], xs[m].shape[1], self.d_model)
        tag = self.p2p.tag(EVAL_ACT, s - 1, m, self.n_seg, len(xs))
        what = f"evaluation activations of chunk {s} microbatch {m}"
        return self.p2p.recv(shape, self.act_dtype, self.rank_of(s - 1), tag, what)
