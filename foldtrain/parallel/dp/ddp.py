"""``--dp.strategy ddp``: torch ``DistributedDataParallel`` (the paper's "distributed parameter server").

Every rank holds a replica; DDP all-reduces gradients in buckets of ``--dp.bucket_mb`` while
backward still runs, and ``no_sync`` skips that on accumulation micro-batches. The bucket
all-reduce is our own comm hook (the same arithmetic as DDP's default: divide by the world,
sum) so its bytes are counted. The wait that is not hidden behind backward is measured from
the moment the last bucket is launched (backward compute is done then) to the end of backward,
where DDP blocks on the outstanding buckets. ``self.model`` stays the unwrapped module, so
checkpoints carry the plain parameter names. ``--dp.compression fp16|bf16`` sends each bucket in that dtype
and copies the sum back into it, as torch's ``bf16_compress_hook`` does.
"""

import time  # no `from __future__ import annotations`: DDP checks the comm hook's return annotation object

import torch
from torch.nn.parallel import DistributedDataParallel

from foldtrain import collectives
from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.wire import outbound, wire_dtype


class DDPStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=ids, bucket_cap_mb=cfg.dp.bucket_mb)
        self.ddp.register_comm_hook(None, self._allreduce_bucket)
        self._last_launch: float | None = None
        self.wire = wire_dtype(cfg.dp.compression, next(self.model.parameters()).dtype)

    def _allreduce_bucket(self, _state, bucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        sent = outbound(buf, self.world, self.wire)
        self.comm.count_all_reduce(sent)
        self.comm.phase = "DDP gradient all-reduce"
        self._last_launch = time.perf_counter()
        fut = collectives.all_reduce(sent, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] if sent is buf else buf.copy_(f.value()[0]))

    def forward(self, x):
        return self.ddp(x)

    def no_sync(self):
        return self.ddp.no_sync()

    def sync_grads(self) -> None:
        # DDP already waited for its buckets at the end of backward; book the exposed part
        if self._last_launch is not None:
            self.comm.wait_s += time.perf_counter() - self._last_launch
            self._last_launch = None
