"""One executor for every pipeline schedule: it runs a rank's action list for one iteration.

Schedules are data (:mod:`foldtrain.schedules`); this module gives each action its meaning:

* ``F(s, m)``  forward of local segment ``s`` on micro-batch ``m``. Segment 0 takes the tokens;
  any other segment the activation ``RA`` received, as a leaf with ``requires_grad`` (its ``.grad``
  is what ``SG`` sends back). The LAST segment fuses its head: it runs the body, then the head and
  the loss on the detached hidden state and immediately their backward, frees the logits and keeps
  only ``d loss / d hidden`` for its ``B`` (Fold3D's fused head: the last rank can start backward
  right after its last forward, and never holds more than one micro-batch's logits).
* ``B(s, m)``  backward of the stored output with the received (or fused-head) gradient.
* ``SA`` / ``SG``  ``isend`` of the output / input gradient; NEVER waited on before the end of the
  iteration, so a send cannot block the executor (the interleaved and fold schedules deadlock
  when sends rendezvous with receives: see ``foldtrain/schedules/validate.py``).
* ``RA`` / ``RG``  ``irecv`` into a buffer of the known shape ``(rows, seq, d_model)``, then a
  wait bounded by ``--dp.timeout_s``: a peer that stalls or dies turns into a
  :class:`~foldtrain.errors.DistributedError` naming it and the transfer.
* ``LR(c)`` launches chunk ``c``'s data-parallel gradient all-reduce (averaged over dp)
  asynchronously, with a deadline: the position of the ``WR(c)`` that needs it, in the next
  iteration for a deferred chunk. Urgent (same-iteration) reductions are issued at once; deferred
  ones in buckets, in deadline order, never ahead of an urgent one (:mod:`.deadlines`; the
  ``--profile`` trace shows each bucket as a ``reduce`` event with its deadline and issue order).
  ``WR(c)`` waits and unpacks; ``OS(c)`` steps the chunk's
  own optimizer and LR schedule. Gradient clipping (global norm over every chunk, pipeline rank
  and TP rank) and the fp16 overflow check happen once, just before the first ``OS`` at the end of
  the iteration, when all ``WR`` are done. Without them (``early_steps``, set by the engine) a
  chunk steps right after its ``WR``, while later reductions are still in flight, its partial
  squared norm kept for the logged gradient norm.
* With ``defer_reduce`` the ``WR(c)`` / ``OS(c)`` placed before chunk ``c``'s first forward
  complete the reduction launched in the PREVIOUS iteration (skipped when none is pending);
  :meth:`Executor.flush` completes the pending ones (end of training, checkpoints, evaluation).

* The tied embedding's two copies (segment 0 and the last segment) are reduced over dp by each end
  at its ``LR`` (the head's, with per-chunk sync, already after the last segment's last forward,
  where the fused head made it final) and exchanged between the two ends afterwards (:mod:`.tie`):
  each end hands over the moment its dp reduction lands (polled after every action), at the latest
  before its next ``WR`` / ``OS`` or the end of the iteration; the embedding end's token ids are
  all-gathered when the iteration starts.

Transport (:mod:`.p2p`), the per-chunk reductions (:mod:`.reducer`) and the tie (:mod:`.tie`) live beside this module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from foldtrain.parallel.pipeline.p2p import P2P
from foldtrain.schedules import Op, Schedule

ACT, GRAD, EVAL_ACT = 0, 1, 2


class Executor:
    """Runs one pipeline rank's action list per iteration over its chunks."""

    def __init__(
        self,
        chunks: dict,  # global segment -> Chunk
        n_segments: int,
        topo,
        p2p: P2P,
        reducers: dict,  # global segment -> ChunkReducer
        step_chunk: Callable[[int], None],  # OS(c): optimizer + LR-schedule step of a chunk
        before_steps: Callable[[], None],  # once per iteration before the first non-deferred OS
        precision,
        loss_fn: Callable,
        act_dtype: torch.dtype,
        d_model: int,
        timeline,
        sync: Callable[[], None] | None = None,
    ):
        self.chunks = chunks
        self.n_seg = n_segments
        self.topo = topo
        self.pp = topo.pp
        self.p = topo.pp_rank
        self.p2p = p2p
        self.reducers = reducers
        self.step_chunk = step_chunk
        self.before_steps = before_steps
        self.precision = precision
        self.loss_fn = loss_fn
        self.act_dtype = act_dtype
        self.d_model = d_model
        self.tl = timeline
        self.sync = sync or (lambda: None)
        self.step_pending: set[int] = set()  # chunks whose reduction was launched but not yet stepped
        self.queue = None  # DeadlineQueue (attach_queue): deadline-ordered data-parallel reductions
        # a chunk stepped as soon as its reduction lands (set by the engine when no global norm or
        # loss-scaler verdict has to come first); its squared gradient norm is kept for the log
        self.early_steps = False
        self.chunk_norm_sq: Callable[[int], torch.Tensor] | None = None
        self.partial_sq: dict[int, torch.Tensor] = {}
        self._early: set[int] = set()

    def attach_queue(self, queue) -> None:
        """Route the chunk reductions through ``queue`` (:mod:`foldtrain.parallel.pipeline.deadlines`)."""
        self.queue = queue
        for r in self.reducers.values():
            r.queue = queue
        if queue.group is not None:
            self.p2p.pump = queue.pump

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
        for r in self.reducers.values():
            r.handoff()

    def _peer(self, s: int) -> int:
        return s % self.pp

    def _span(self, name: str, kind: str, **args):
        return self.tl.span(name, kind, **args)

    # ------------------------------------------------------------------ one training iteration
    def run(self, sched: Schedule, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
        """Run this rank's actions of ``sched`` on micro-batches ``xs`` / ``ys``; returns the sum of the
        micro-batch losses divided by M (the rank's mean loss; zero unless it holds the last segment)."""
        actions = sched.ranks[self.p]
        n_mb = sched.microbatches
        deferred = set(sched.deferred_chunks(self.p))
        last = self.n_seg - 1
        scaler = self.precision.scaler
        inputs: dict = {}
        outputs: dict = {}
        acts_in: dict = {}
        grads_in: dict = {}
        in_grads: dict = {}
        sends: list = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=xs[0].device)
        stepped = False
        queue = self.queue
        # each chunk reduction's deadline: the position of the WR that needs it (next iteration's for deferred ones)
        deadline = {
            a.chunk: i + (len(actions) if a.chunk in deferred else 0)
            for i, a in enumerate(actions)
            if a.op is Op.WAIT_REDUCE
        }
        ties = [r for r in self.reducers.values() if r.tie is not None]
        # per-chunk sync: the head's tied copy is reduced from the last segment's last forward on
        # (the fused head's backward made it final), not from its LR after the body's backwards
        head_fwds = (
            n_mb if sched.dp_sync == "per-chunk" and last in self.chunks and self.reducers[last].tie is not None else -1
        )
        for r in ties:
            r.begin(xs)
        if queue is not None:
            queue.pump()

        def shape(m: int) -> tuple[int, int, int]:
            return (xs[m].shape[0], xs[m].shape[1], self.d_model)

        for a in actions:
            if queue is not None:
                queue.pump()
            for r in ties:
                r.progress()
            op, s, m = a.op, a.chunk, a.mb
            if op is Op.FORWARD:
                chunk = self.chunks[s]
                inp = xs[m] if s == 0 else acts_in.pop((s, m)).requires_grad_(True)
                with self._span(f"F c{s} m{m}", "compute", op="F", chunk=s, mb=m):
                    with self.precision.forward_context():
                        out = chunk.body(inp) if s == last else chunk(inp)
                    if s == last:
                        hd = out.detach().requires_grad_(True)
                        with self.precision.forward_context():
                            loss = self.loss_fn(chunk.head(hd), ys[m]) / n_mb
                        scaler.loss(loss).backward()
                        loss_sum += loss.detach().float()
                        out = (out, hd.grad)
                        del hd, loss
                    self.sync()
                inputs[(s, m)] = inp
                outputs[(s, m)] = out
                if s == last and head_fwds > 0:
                    head_fwds -= 1
                    if head_fwds == 0:
                        self.reducers[s].launch_tie(deadline.get(s, len(actions)))
            elif op is Op.BACKWARD:
                out = outputs.pop((s, m))
                inp = inputs.pop((s, m))
                with self._span(f"B c{s} m{m}", "compute", op="B", chunk=s, mb=m):
                    if s == last:
                        torch.autograd.backward(out[0], out[1])
                    else:
                        torch.autograd.backward(out, grads_in.pop((s, m)))
                    self.sync()
                del out
                if s > 0:
                    in_grads[(s, m)] = inp.grad
            elif op is Op.SEND_ACT:
                t = outputs[(s, m)].detach().to(self.act_dtype).contiguous()
                with self._span(f"SA c{s} m{m}", "send", chunk=s, mb=m, peer=a.peer):
                    sends.append((self.p2p.isend(t, a.peer, self.p2p.tag(ACT, s, m, self.n_seg, n_mb)), t, a))
            elif op is Op.RECV_ACT:
                with self._span(f"RA c{s} m{m}", "recv_wait", chunk=s, mb=m, peer=a.peer):
                    acts_in[(s, m)] = self.p2p.recv(
                        shape(m),
                        self.act_dtype,
                        a.peer,
                        self.p2p.tag(ACT, s - 1, m, self.n_seg, n_mb),
                        f"activations of chunk {s} microbatch {m}",
                    )
            elif op is Op.SEND_GRAD:
                t = in_grads.pop((s, m)).to(self.act_dtype).contiguous()
                with self._span(f"SG c{s} m{m}", "send", chunk=s, mb=m, peer=a.peer):
                    sends.append((self.p2p.isend(t, a.peer, self.p2p.tag(GRAD, s, m, self.n_seg, n_mb)), t, a))
            elif op is Op.RECV_GRAD:
                with self._span(f"RG c{s} m{m}", "recv_wait", chunk=s, mb=m, peer=a.peer):
                    grads_in[(s, m)] = self.p2p.recv(
                        shape(m),
                        self.act_dtype,
                        a.peer,
                        self.p2p.tag(GRAD, s + 1, m, self.n_seg, n_mb),
                        f"gradients of chunk {s} microbatch {m}",
                    )
            elif op is Op.LAUNCH_REDUCE:
                with self._span(
                    f"LR c{s}", "reduce_launch", chunk=s, deadline=deadline.get(s, len(actions)), deferred=s in deferred
                ):
                    self.reducers[s].launch(deadline.get(s, len(actions)), s in deferred)
                self.step_pending.add(s)
            elif op is Op.WAIT_REDUCE:
                self._handoff()
                if s in deferred and not self.reducers[s].pending:
                    continue  # first iteration, or flushed: nothing launched last iteration
                with self._span(f"WR c{s}", "reduce_wait", chunk=s, deferred=s in deferred):
                    self.reducers[s].wait()
                if self.early_steps and s not in deferred:  # its optimizer needs nothing else: step now
                    if self.chunk_norm_sq is not None:
                        self.partial_sq[s] = self.chunk_norm_sq(s)
                    with self._span(f"OS c{s}", "optim", chunk=s, early=True):
                        self.step_chunk(s)
                    self._early.add(s)
            elif op is Op.OPTIM_STEP:
                self._handoff()
                if s in deferred:
                    if s in self.step_pending:
                        with self._span(f"OS c{s}", "optim", chunk=s, deferred=True):
                            self.step_chunk(s)
                        self.step_pending.discard(s)
                    continue
                if not stepped:
                    stepped = True
                    with self._span("clip", "optim"):
                        self.before_steps()
                if s in self._early:
                    self._early.discard(s)
                    self.step_pending.discard(s)
                    continue
                with self._span(f"OS c{s}", "optim", chunk=s):
                    self.step_chunk(s)
                self.step_pending.discard(s)
            else:  # pragma: no cover - the schedule validator knows every op
                raise ValueError(f"unknown pipeline action {a}")
        self._handoff()
        for work, _t, a in sends:
            kind = "activations" if a.op is Op.SEND_ACT else "gradients"
            self.p2p.wait(
                work, f"its receive of the {kind} of chunk {a.chunk} microbatch {a.mb} (send completion)", a.peer
            )
        if inputs or outputs or acts_in or grads_in or in_grads:  # pragma: no cover - validated schedules
            raise RuntimeError(f"pipeline rank {self.p}: schedule left unfinished work {list(inputs)[:4]}")
        return loss_sum

    def end_iteration(self) -> None:
        """After every rank finished the iteration (the engine calls it after the loss all-reduce):
        the deferred buckets still held back are issued (:meth:`DeadlineQueue.end_iteration`).

        Not at the end of :meth:`run`: a rank that finishes early (the head's, whose last reduction
        is small) would then put its deferred buckets on the node's link while another rank of the
        node still waits for its urgent reduction (chunk 0's, the step's critical path); measured on
        the 1 Gbit/s bench, fold + deferral V = 4, that cost 13% of the throughput."""
        if self.queue is not None:
            self.queue.end_iteration()

    def reset(self) -> None:
        """Drop every pending deferred reduction and step (before loading a checkpoint)."""
        self.step_pending.clear()
        for r in self.reducers.values():
            r.reset()

    def flush(self) -> None:
        """Complete every deferred reduction and optimizer step (before reading or saving weights)."""
        for s in sorted(self.step_pending):
            with self._span(f"WR c{s}", "reduce_wait", chunk=s, flush=True):
                self.reducers[s].wait()
            with self._span(f"OS c{s}", "optim", chunk=s, flush=True):
                self.step_chunk(s)
        self.step_pending.clear()

    # ------------------------------------------------------------------ forward only (evaluation)
    @torch.no_grad()
    def forward_only(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """Loss of every micro-batch (on the rank holding the last segment; empty elsewhere).

        Order: each local segment in model order, all micro-batches (breadth-first): deadlock-free
        with non-blocking sends because every receive depends only on lower segments.
        """
        n_mb = len(xs)
        last = self.n_seg - 1
        losses: list[torch.Tensor] = []
        sends: list = []
        for s in sorted(self.chunks):
            chunk = self.chunks[s]
            for m in range(n_mb):
                if s == 0:
                    inp = xs[m]
                else:
                    peer = self._peer(s - 1)
                    inp = self.p2p.recv(
                        (xs[m].shape[0], xs[m].shape[1], self.d_model),
                        self.act_dtype,
                        peer,
                        self.p2p.tag(EVAL_ACT, s - 1, m, self.n_seg, n_mb),
                        f"evaluation activations of chunk {s} microbatch {m}",
                    )
                with self.precision.forward_context():
                    out = chunk(inp)
                    if s == last:
                        losses.append(self.loss_fn(out, ys[m]).float())
                        continue
                t = out.to(self.act_dtype).contiguous()
                sends.append(
                    (self.p2p.isend(t, self._peer(s + 1), self.p2p.tag(EVAL_ACT, s, m, self.n_seg, n_mb)), t, s, m)
                )
        for work, _t, s, m in sends:
            self.p2p.wait(
                work, f"its receive of evaluation activations of chunk {s + 1} microbatch {m}", self._peer(s + 1)
            )
        return losses
