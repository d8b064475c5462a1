"""``--dp.strategy ps --dp.ps_staleness S`` (S > 0): a bounded-staleness asynchronous parameter server.

A worker pushes its gradient and goes on with whatever parameters the server sends back,
without waiting for the other workers. The server applies every worker's gradient on its own,
as it arrives, with the learning rate divided by the number of workers N (so a round of N
gradients moves the weights about as far as one synchronous step; AdamW's moments and step
count advance once per gradient), and answers that worker with its current parameters.

Clocks and staleness: the server counts the gradients it has received from each worker (the
worker's clock). It withholds a worker's reply while that worker would start a step more than
S steps ahead of the slowest worker (stale-synchronous parallel): the worker blocks in its
receive. The staleness of a gradient is the step it was computed for minus the slowest
worker's clock when its parameters were sent, i.e. how many of the slowest worker's rounds its
parameters may be missing; it never exceeds S. ``stats()`` reports it on servers as
``ps_staleness`` (this step's maximum) and ``ps_staleness_max`` (the run's).

One server ``train_step`` serves until every worker's gradient for that step has been applied,
applying faster workers' later gradients meanwhile. Receives are posted one per worker, never
from any source (NCCL has no any-source receive), each right after the reply to that worker (NCCL
runs a pair's transfers in the order they were posted: a receive posted before the reply would
wait for a gradient the worker sends only after that reply), on a group of their own. Arrivals are
found by polling ``Work.is_completed``, except on gloo, where a receive reports completion only from ``wait``
(torch 2.13), so there a short-lived thread waits on each and reports through a queue. (Only the
gloo path is exercised by the tests, which run on CPU.)

Per gradient, the worker sends a small fp64 header: whether its gradient is finite (its own
fp16 loss-scaler decision: in async every worker's scaler is independent and the server skips
a non-finite gradient), its squared norm and loss scale (the server unscales and clips each
gradient by its own global norm, also across several servers), and its loss. The loss a
worker reports is its own; a server reports the mean over workers of the losses for its step.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time

import torch
import torch.distributed as dist

from foldtrain.parallel.dp.ps import GRAD_TAG, HEADER_TAG, PARAM_TAG, ParameterServerStrategy
from foldtrain.parallel.failures import CommFailure
from foldtrain.parallel.flat import flatten, unflatten_into


class AsyncParameterServerStrategy(ParameterServerStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        self.staleness = cfg.dp.ps_staleness
        self.total_steps = cfg.train.steps
        self.clock: dict[int, int] = {}  # server: gradients received per worker (set at the first step)
        self.sent_at: dict[int, int] = {}  # server: the slowest clock when each worker was last sent parameters
        self.deferred: set[int] = set()
        self.posted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.arrivals: queue.Queue = queue.Queue()  # gloo: (worker, error or None) from the waiting threads
        self.polled: dict[int, list] = {}  # other backends: receives to poll
        self.reply_sends: list = []
        self.step_losses: dict[int, list[float]] = {}
        self.step_staleness = self.max_staleness = 0
        self._losses: list[torch.Tensor] = []
        self._served_step = 0
        # The server keeps a receive posted for each worker across steps. On NCCL a group's transfers and collectives
        # share its communicator's stream, where that receive would hold up the step's collectives on the default
        # group (which the worker joins before it sends again): the pushes and replies get a group of their own.
        self.comm.p2p_group = dist.new_group(list(range(self.world)))

    def server_optim_config(self, cfg):
        return dataclasses.replace(cfg.optim, lr=cfg.optim.lr / len(self.workers))

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.lr_scheduler.last_epoch)

    def stats(self) -> dict[str, float]:
        extra = {"ps_staleness": self.step_staleness, "ps_staleness_max": self.max_staleness} if self.is_server else {}
        return {**super().stats(), **extra}

    # ------------------------------------------------------------------ worker side
    def record_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.float())

    def sync_grads(self) -> None:
        """Nothing to average: each gradient is applied on its own (in ``apply_update``)."""

    def global_finite(self, finite: bool) -> bool:
        """A worker's own verdict on its gradient (servers hold no gradient here)."""
        if not (self.is_worker and self.precision.scaler.enabled):
            return finite
        return all(bool(torch.isfinite(p.grad).all()) for p in self.params if p.grad is not None)

    def header(self, finite: bool) -> torch.Tensor:
        """[finite, squared norm of the (scaled) gradient, loss scale, mean loss], fp64."""
        clipping = finite and self.cfg.optim.grad_clip > 0
        sq = sum(float(p.grad.float().pow(2).sum()) for p in self.params if p.grad is not None) if clipping else 0.0
        loss = float(torch.stack(self._losses).mean()) if self._losses else 0.0
        self._losses = []
        scale = self.precision.scaler.scale if self.precision.scaler.enabled else 1.0
        return torch.tensor([1.0 if finite else 0.0, sq, scale, loss], dtype=torch.float64, device=self.device)

    def apply_update(self, grads_finite: bool) -> None:
        dtype = self.precision.param_dtype
        sends, own = [], None
        if self.is_worker:
            head = self.header(grads_finite)
            for s in self.servers:
                if s == self.rank:
                    own = (self.grads_for(s, dtype), head)
                else:
                    sends += [
                        (s, self.comm.isend(head, s, HEADER_TAG)),
                        (s, self.comm.isend(self.grads_for(s, dtype), s, GRAD_TAG)),
                    ]
        if self.is_server:
            self.serve(own)
        if self.is_worker:
            for s in self.servers:
                if s != self.rank:
                    buf = torch.empty(self.size_of(s), dtype=dtype, device=self.device)
                    self.comm.wait(self.comm.irecv(buf, s, PARAM_TAG), "parameter pull", peer=s)
                    unflatten_into(buf, [self.params[i] for i in self.served[s]])
        for s, work in sends:
            self.comm.wait(work, "gradient push", peer=s)
        self.step_schedule()

    # ------------------------------------------------------------------ server side
    def serve(self, own) -> None:
        """Apply gradients as they arrive until every worker's gradient of this step is in."""
        step = self.lr_scheduler.last_epoch
        if not self.clock:
            self.clock = {w: step for w in self.workers}
            self.sent_at = dict(self.clock)
            for w in self.workers:
                if w != self.rank:
                    self.post(w)
        self._served_step, self.step_staleness = step, 0
        if own is not None:
            self.apply_gradient(self.rank, *own)
        while min(self.clock.values()) <= step:
            with self.comm.blocked("gradient push"):
                w = self.next_arrival()
            grad, head = self.posted.pop(w)
            self.comm.count_received(grad, head)
            self.apply_gradient(w, grad, head)
        for w, work in self.reply_sends:
            self.comm.wait(work, "parameter reply", peer=w)
        self.reply_sends = []
        if self.is_worker:  # colocated: this rank's own replica gets the freshest parameters
            unflatten_into(
                flatten(list(self.masters.values()), self.precision.param_dtype),
                [self.params[i] for i in self.served[self.rank]],
            )
            self.sent_at[self.rank] = min(self.clock.values())

    def post(self, w: int) -> None:
        """Post the receive of worker ``w``'s next header and gradient."""
        grad = torch.empty(self.size_of(self.rank), dtype=self.precision.param_dtype, device=self.device)
        head = torch.empty(4, dtype=torch.float64, device=self.device)
        works = [self.comm.irecv(head, w, HEADER_TAG, count=False), self.comm.irecv(grad, w, GRAD_TAG, count=False)]
        self.posted[w] = (grad, head)
        if dist.get_backend() != "gloo":
            self.polled[w] = works
            return

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
                self.arrivals.put((w, None))
            except Exception as e:  # reported to the serving loop, which names the worker
                self.arrivals.put((w, e))

        threading.Thread(target=wait, daemon=True, name=f"ps-recv-{w}").start()

    def next_arrival(self) -> int:
        """The next worker whose gradient has arrived (its receive is complete)."""
        deadline = time.monotonic() + self.cfg.dp.timeout_s + 10
        while time.monotonic() < deadline:
            for w, works in list(self.polled.items()):
                if all(work.is_completed() for work in works):
                    del self.polled[w]
                    return w
            try:
                w, err = self.arrivals.get(timeout=0.001 if self.polled else 0.1)
            except queue.Empty:
                continue
            if err is not None:
                raise CommFailure("gradient push", w, err)
            return w
        raise CommFailure("gradient push", None, TimeoutError("no gradient arrived"))

    @torch.no_grad()
    def apply_gradient(self, w: int, grad: torch.Tensor, head: torch.Tensor) -> None:
        finite, sq, scale, loss = head.tolist()
        k = self.clock[w]  # the worker's step this gradient was computed for
        self.step_losses.setdefault(k, []).append(loss)
        staleness = k - self.sent_at[w]
        self.step_staleness = max(self.step_staleness, staleness)
        self.max_staleness = max(self.max_staleness, staleness)
        if finite:
            g = grad.float().mul_(1.0 / scale)
            clip = self.cfg.optim.grad_clip
            norm = math.sqrt(sq) / scale
            if clip > 0 and norm + 1e-6 > clip:
                g.mul_(clip / (norm + 1e-6))
            self.last_grad_norm = norm
            self.set_master_grads(g)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.clock[w] += 1
        self.deferred.add(w)
        self.reply_allowed()

    def reply_allowed(self) -> None:
        """Send parameters to every waiting worker that would not get more than S steps ahead."""
        slowest = min(self.clock.values())
        mine = None
        for w in sorted(self.deferred):
            if self.clock[w] - slowest <= self.staleness:
                self.deferred.discard(w)
                self.sent_at[w] = slowest
                if w != self.rank:
                    mine = (
                        mine if mine is not None else flatten(list(self.masters.values()), self.precision.param_dtype)
                    )
                    self.reply_sends.append((w, self.comm.isend(mine, w, PARAM_TAG)))
                    if self.clock[w] < self.total_steps:  # after the reply: NCCL runs a pair's transfers in order
                        self.post(w)

    def reduce_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """A worker's own loss; a server's mean over workers of the losses of the step it served."""
        if self.is_server:
            losses = self.step_losses.pop(self._served_step, [])
            return torch.tensor(sum(losses) / max(1, len(losses)))
        return value
