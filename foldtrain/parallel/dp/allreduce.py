"""``--dp.strategy allreduce``: Horovod-style ring all-reduce with tensor fusion, overlapped with backward.

On the last micro-batch, a post-accumulate-grad hook on every parameter marks its gradient ready
the moment backward has finished it. Gradients are fused into buckets; a bucket is packed into one
buffer and all-reduced asynchronously (``async_op=True``) as soon as all its gradients are ready,
while backward goes on. ``sync_grads`` launches what is left, waits, unpacks and divides by the
world size (Horovod's average).

The buckets (:mod:`foldtrain.parallel.dp.buckets`) are cut the way Horovod's background loop
would cut them, but once, and the same on every rank:

* the first bucket closes at ``--dp.first_bucket_mb`` (small, like DDP's first bucket, so the
  link starts working early in the backward);
* any bucket closes at ``--dp.fusion_mb`` (Horovod's fusion threshold);
* a bucket closes when ``--dp.cycle_ms`` has passed since the last launch
  (``HOROVOD_CYCLE_TIME``), so a small model whose gradients all fit one fusion buffer still
  overlaps its backward.

The time-based cut uses the gradient-ready times rank 0 observes in the first step: rank 0 turns
them into a bucket plan and broadcasts it (one ``broadcast_object_list``). A cycle-time flush
decided on each rank from its own clock would cut different buckets on different ranks. From
then on buckets launch in the plan's order on every rank (``OrderedLauncher``), whatever order
the hooks fire in. The first step reduces every bucket after its backward (no overlap, once).
The plan is saved in checkpoints (``dp_plan``) so a resumed run sums in the same buckets.

``--dp.compression fp16|bf16`` casts each packed fp32 buffer to that dtype for the wire and back
after (:mod:`foldtrain.parallel.wire`). In the master precisions the gradients are already half, so they
travel half, in their own dtype.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.dp.buckets import OrderedLauncher, timed_plan
from foldtrain.parallel.dp.comm import nbytes
from foldtrain.parallel.flat import flatten, unflatten_into
from foldtrain.parallel.wire import outbound, wire_dtype


class AllreduceStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        d = cfg.dp
        self.fusion_bytes = d.fusion_mb * 2**20
        self.first_bytes = min(d.first_bucket_mb * 2**20, self.fusion_bytes)
        self.cycle_s = d.cycle_ms / 1000.0
        self.params = [p for _, p in self.named_params]
        self.wire_dtype = wire_dtype(d.compression, self.params[0].dtype)  # None: the gradients' own
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._accumulating = False  # inside no_sync: hooks do nothing
        self._events: list[tuple[int, float]] = []  # first step: (parameter, ready time)
        self.plan: list[list[int]] | None = None
        self.launcher: OrderedLauncher | None = None
        self.launch_log: list[list[int]] = []  # per step: bucket indices in launch order
        self._inflight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @contextlib.contextmanager
    def no_sync(self):
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if self._accumulating:
            return
        i = self._index[id(p)]
        if self.launcher is None:
            self._events.append((i, time.perf_counter()))
        else:
            self.launcher.ready(i)

    def _make_plan(self) -> None:
        """Rank 0 cuts the buckets from its first backward's timing; every rank receives them."""
        holder = [None]
        if self.rank == 0:
            sizes = [nbytes(p) for p in self.params]
            holder = [
                timed_plan(self._events, sizes, len(self.params), self.first_bytes, self.fusion_bytes, self.cycle_s)
            ]
        with self.comm.blocked("bucket-plan broadcast"):
            dist.broadcast_object_list(holder, src=0)
        self.plan = holder[0]
        self.launcher = OrderedLauncher(self.plan, self._launch)
        self._events = []

    def _launch(self, k: int) -> None:
        """Pack bucket ``k``'s gradients into one fusion buffer and start its all-reduce."""
        params = [self.params[i] for i in self.plan[k]]
        for p in params:  # a parameter this backward did not reach contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        buf = outbound(flatten(grads, self.wire_dtype or grads[0].dtype), self.world, self.wire_dtype)
        self.comm.count_all_reduce(buf)
        self.comm.phase = "all-reduce"
        self._inflight.append((collectives.all_reduce(buf, async_op=True), buf, grads))

    def sync_grads(self) -> None:
        if self.launcher is None:
            self._make_plan()
        self.launcher.finish()
        self.launch_log.append(self.launcher.log)
        for work, buf, grads in self._inflight:
            self.comm.wait(work, "all-reduce")
            unflatten_into(buf.to(grads[0].dtype), grads)
        self._inflight = []
        self.launcher.reset()

    # ------------------------------------------------------------------ the plan travels with checkpoints
    def _plan_tensor(self) -> torch.Tensor:
        """The plan as one int64 tensor: parameter indices in bucket order, then each one's bucket (-1: none yet)."""
        n = len(self.params)
        t = torch.full((2 * n,), -1, dtype=torch.int64)
        if self.plan is not None:
            flat = [(i, k) for k, b in enumerate(self.plan) for i in b]
            t[:n] = torch.tensor([i for i, _ in flat])
            t[n:] = torch.tensor([k for _, k in flat])
        return t

    def model_optim_state(self) -> dict:
        """A resumed run reuses the buckets of the run it continues: the same sums, to the last bit."""
        return {**super().model_optim_state(), "dp_plan": self._plan_tensor()}

    def load_model_optim_state(self, sd: dict) -> None:
        super().load_model_optim_state(sd)
        t, n = sd["dp_plan"], len(self.params)
        if int(t.min()) >= 0:
            plan: list[list[int]] = []
            for i, k in zip(t[:n].tolist(), t[n:].tolist()):
                if k == len(plan):
                    plan.append([])
                plan[k].append(i)
            self.plan = plan
            self.launcher = OrderedLauncher(plan, self._launch)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "dp_buckets": float(len(self.plan or []))}
