"""``--dp.strategy allreduce``: Horovod-style ring all-reduce with tensor fusion, in plain torch.distributed.

On the last micro-batch, a post-accumulate-grad hook on every parameter queues its gradient
the moment backward has finished it. Queued gradients are packed into one fusion buffer; when
the buffer reaches ``--dp.fusion_mb`` it is all-reduced asynchronously (``async_op=True``)
while backward goes on, and a new buffer starts. ``sync_grads`` launches the last, partial
buffer, waits for all of them, unpacks and divides by the world size (Horovod's average).

``--dp.compression fp16|bf16`` casts each packed buffer to that dtype for the wire and back
after. In the master precisions the gradients are already half, so they travel half.

Order: buffers must hold the same gradients, in the same order, on every rank. They follow the
order the hooks fire, which is the autograd engine's execution order: deterministic for one and
the same graph (ready nodes run by sequence number), so identical on every rank and every step,
the property DDP's bucket rebuilding also relies on. Horovod instead negotiates the order through
a coordinator, which a graph that differs between ranks would need.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.dp.comm import nbytes
from foldtrain.parallel.flat import flatten, unflatten_into

WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class AllreduceStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        self.fusion_bytes = cfg.dp.fusion_mb * 2**20
        self.wire_dtype = WIRE_DTYPES[cfg.dp.compression]
        self._accumulating = False  # inside no_sync: hooks do nothing
        self._queued: list[torch.nn.Parameter] = []
        self._queued_bytes = 0
        self._inflight: list[tuple[dist.Work, torch.Tensor, list[torch.nn.Parameter]]] = []
        for _, p in self.named_params:
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
        self._queued.append(p)
        self._queued_bytes += nbytes(p.grad)
        if self._queued_bytes >= self.fusion_bytes:
            self._launch()

    def _launch(self) -> None:
        """Pack the queued gradients into one fusion buffer and start its all-reduce."""
        buf = flatten([p.grad for p in self._queued], self.wire_dtype or self._queued[0].grad.dtype)
        self.comm.all_reduce(buf)
        self.comm.phase = "all-reduce"
        self._inflight.append((dist.all_reduce(buf, async_op=True), buf, self._queued))
        self._queued, self._queued_bytes = [], 0

    def sync_grads(self) -> None:
        if self._queued:
            self._launch()
        for work, buf, params in self._inflight:
            self.comm.wait(work, "all-reduce")
            unflatten_into(buf.to(params[0].grad.dtype).div_(self.world), [p.grad for p in params])
        self._inflight = []
