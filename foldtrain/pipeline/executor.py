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
  when sends rendezvous with receives: see ``schedules/validate.py``).
* ``RA`` / ``RG``  ``irecv`` into a buffer of the known shape ``(rows, seq, d_model)``, then a
  wait bounded by ``--dp.timeout_s``: a peer that stalls or dies turns into a
  :class:`~foldtrain.errors.DistributedError` naming it and the transfer.
* ``LR(c)`` launches chunk ``c``'s data-parallel gradient all-reduce (one flat fused buffer per
  chunk, averaged over dp) asynchronously; ``WR(c)`` waits and unpacks; ``OS(c)`` steps the chunk's
  own optimizer and LR schedule. Gradient clipping (global norm over every chunk, pipeline rank
  and TP rank) and the fp16 overflow check happen once, just before the first ``OS`` at the end of
  the iteration, when all ``WR`` are done.
* With ``defer_reduce`` the ``WR(c)`` / ``OS(c)`` placed before chunk ``c``'s first forward
  complete the reduction launched in the PREVIOUS iteration (skipped when none is pending);
  :meth:`Executor.flush` completes the pending ones (end of training, checkpoints, evaluation).

Transport: every message between pipeline ranks ``a -> b`` goes over the topology's direction
group for that pair (``p2p_up`` if ``a < b`` else ``p2p_down``) with a tag unique to
(kind, producing segment, micro-batch). gloo matches by tag, and ``isend`` never blocks the CPU.
With NCCL (no tags; one stream per communicator and pair, operations in posting order) each
(group, pair) carries one direction only, so a send never sits in front of a receive, and the
per-pair posting orders match because the schedules are validated for per-pair FIFO channels;
receives are waited on without a CPU timeout there (stream-ordered; the NCCL watchdog enforces
the process-group timeout instead). The NCCL path has NOT been run yet (the test machines have no
multi-GPU host); in particular, if a PyTorch version routes the P2P of an eagerly initialised group
through the group's single communicator instead of per-pair ones, sends and receives of different
peers would share one stream again and interleaved / fold could stall: check there first.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from foldtrain.errors import DistributedError
from foldtrain.parallel.dp.base import flatten, unflatten_into
from foldtrain.schedules import Op, Schedule

ACT, GRAD, EVAL_ACT = 0, 1, 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view that in-place ops write through), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:200]
    return type(e).__name__


def bounded_wait(work, timeout_s: float, bounded: bool, problem) -> None:
    """Wait for ``work`` at most ``timeout_s`` (where the backend supports a bounded wait); on a
    timeout or a broken connection raise one DistributedError line, ``problem(cause)``."""
    try:
        work.wait(timedelta(seconds=timeout_s)) if bounded else work.wait()
    except Exception as e:  # gloo: RuntimeError / DistBackendError on timeout or a closed connection
        raise DistributedError(problem(_first_line(e))) from None


class P2P:
    """Point-to-point transfers of one pipeline (see the module docstring)."""

    def __init__(self, topo, timeout_s: float, device: torch.device):
        self.topo = topo
        self.timeout_s = float(timeout_s)
        self.device = device
        self.p = topo.pp_rank
        self.cpu_timeout = device.type != "cuda"

    def tag(self, kind: int, seg: int, mb: int, n_seg: int, n_mb: int) -> int:
        return (kind * n_seg + seg) * n_mb + mb

    def isend(self, t: torch.Tensor, dst_p: int, tag: int):
        return dist.isend(t, group=self.topo.p2p_group(self.p, dst_p), group_dst=dst_p, tag=tag)

    def recv(self, shape, dtype, src_p: int, tag: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, group=self.topo.p2p_group(src_p, self.p), group_src=src_p, tag=tag)
        self.wait(work, what, src_p)
        return buf

    def wait_collective(self, work, what: str) -> None:
        """Wait for a collective of this rank's pipeline group, bounded by ``--dp.timeout_s``."""
        bounded_wait(work, self.timeout_s, self.cpu_timeout, lambda cause: (
            f"pipeline rank {self.p} (global rank {self.topo.rank}) waited up to {self.timeout_s:g} s for the {what}; "
            f"another pipeline rank stalled or died ({cause}); check the other ranks' logs"))

    def wait(self, work, what: str, peer_p: int) -> None:
        bounded_wait(work, self.timeout_s, self.cpu_timeout, lambda cause: (
            f"pipeline rank {self.p} (global rank {self.topo.rank}) waited up to {self.timeout_s:g} s for {what} "
            f"from pipeline rank {peer_p} (global rank {self.topo.pipeline_peer(peer_p)}); that rank stalled or died "
            f"({cause}); check its log, or raise --dp.timeout_s if it is just slow"))


class ChunkReducer:
    """A chunk's data-parallel gradient all-reduce: one flat fused buffer, averaged over dp, async.

    ``tied`` (the embedding / output-projection copy this chunk holds when the pipeline splits the
    tie) is reduced separately over the tie group (both copies, all dp replicas: sum / dp).
    """

    def __init__(self, segment: int, params: list, tied, topo, timeout_s: float, cpu_timeout: bool):
        self.segment = segment
        self.params = [p for p in params if p is not tied]
        self.tied = tied
        self.topo = topo
        self.dp = topo.dp
        self.timeout_s = timeout_s
        self.cpu_timeout = cpu_timeout
        self.flat = None
        self.work = None
        self.tie_work = None
        self.pending = False  # launched, not yet waited

    def _grads(self, params) -> list[torch.Tensor]:
        """Local gradient tensors, in the parameters' own layouts.

        A DTensor parameter's gradient may come back in another layout (the vocab-parallel
        embedding's weight gradient is ``Replicate`` while the weight is ``Shard(0)``): it is
        redistributed to the parameter's placements first (Replicate -> Shard is a local slice), so
        every replica and both tied copies reduce tensors of the same shape.
        """
        out = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                g = g.redistribute(p.device_mesh, p.placements)
                p.grad = g
            out.append(_local(g))
        return out

    def launch(self) -> None:
        if self.dp > 1:
            grads = self._grads(self.params)
            self.flat = flatten(grads, grads[0].dtype).div_(self.dp)
            self.work = dist.all_reduce(self.flat, group=self.topo.dp_group, async_op=True)
        if self.tied is not None:
            (g,) = self._grads([self.tied])
            if self.dp > 1:
                g.div_(self.dp)
            self.tie_work = dist.all_reduce(g, group=self.topo.tie_group, async_op=True)
        self.pending = True

    def _wait(self, work, what: str) -> None:
        bounded_wait(work, self.timeout_s, self.cpu_timeout, lambda cause: (
            f"global rank {self.topo.rank} waited up to {self.timeout_s:g} s for the {what} of segment {self.segment}; "
            f"a rank of that group stalled or died ({cause}); check the other ranks' logs"))

    def wait(self) -> None:
        if not self.pending:
            return
        if self.work is not None:
            self._wait(self.work, "data-parallel gradient all-reduce")
            unflatten_into(self.flat, self._grads(self.params))
            self.work, self.flat = None, None
        if self.tie_work is not None:
            self._wait(self.tie_work, "tied-embedding gradient all-reduce")
            self.tie_work = None
        self.pending = False


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

    # ------------------------------------------------------------------ helpers
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

        def shape(m: int) -> tuple[int, int, int]:
            return (xs[m].shape[0], xs[m].shape[1], self.d_model)

        for a in actions:
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
                        shape(m), self.act_dtype, a.peer, self.p2p.tag(ACT, s - 1, m, self.n_seg, n_mb),
                        f"activations of chunk {s} microbatch {m}",
                    )
            elif op is Op.SEND_GRAD:
                t = in_grads.pop((s, m)).to(self.act_dtype).contiguous()
                with self._span(f"SG c{s} m{m}", "send", chunk=s, mb=m, peer=a.peer):
                    sends.append((self.p2p.isend(t, a.peer, self.p2p.tag(GRAD, s, m, self.n_seg, n_mb)), t, a))
            elif op is Op.RECV_GRAD:
                with self._span(f"RG c{s} m{m}", "recv_wait", chunk=s, mb=m, peer=a.peer):
                    grads_in[(s, m)] = self.p2p.recv(
                        shape(m), self.act_dtype, a.peer, self.p2p.tag(GRAD, s + 1, m, self.n_seg, n_mb),
                        f"gradients of chunk {s} microbatch {m}",
                    )
            elif op is Op.LAUNCH_REDUCE:
                with self._span(f"LR c{s}", "reduce_launch", chunk=s):
                    self.reducers[s].launch()
                self.step_pending.add(s)
            elif op is Op.WAIT_REDUCE:
                if s in deferred and not self.reducers[s].pending:
                    continue  # first iteration, or flushed: nothing launched last iteration
                with self._span(f"WR c{s}", "reduce_wait", chunk=s, deferred=s in deferred):
                    self.reducers[s].wait()
            elif op is Op.OPTIM_STEP:
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
                with self._span(f"OS c{s}", "optim", chunk=s):
                    self.step_chunk(s)
                self.step_pending.discard(s)
            else:  # pragma: no cover - the schedule validator knows every op
                raise ValueError(f"unknown pipeline action {a}")
        for work, _t, a in sends:
            kind = "activations" if a.op is Op.SEND_ACT else "gradients"
            self.p2p.wait(work, f"its receive of the {kind} of chunk {a.chunk} microbatch {a.mb} (send completion)", a.peer)
        if inputs or outputs or acts_in or grads_in or in_grads:  # pragma: no cover - validated schedules
            raise RuntimeError(f"pipeline rank {self.p}: schedule left unfinished work {list(inputs)[:4]}")
        return loss_sum

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
                    inp = self.p2p.recv((xs[m].shape[0], xs[m].shape[1], self.d_model), self.act_dtype, peer,
                                        self.p2p.tag(EVAL_ACT, s - 1, m, self.n_seg, n_mb), f"evaluation activations of chunk {s} microbatch {m}")
                with self.precision.forward_context():
                    out = chunk(inp)
                    if s == last:
                        losses.append(self.loss_fn(out, ys[m]).float())
                        continue
                t = out.to(self.act_dtype).contiguous()
                sends.append((self.p2p.isend(t, self._peer(s + 1), self.p2p.tag(EVAL_ACT, s, m, self.n_seg, n_mb)), t, s, m))
        for work, _t, s, m in sends:
            self.p2p.wait(work, f"its receive of evaluation activations of chunk {s + 1} microbatch {m}", self._peer(s + 1))
        return losses
