"""``--dp.strategy horovod``: Horovod's own ``hvd.DistributedOptimizer``, where Horovod is installed.

Horovod builds from PyPI only with patches for torch 2.x (``scripts/install-horovod.sh`` makes
them), so it is often absent; the config check (``validate_world``) then refuses the strategy
before any process group exists and points to ``--dp.strategy allreduce``, foldtrain's
Horovod-style ring all-reduce with tensor fusion. Tested against one process by
``tests/parallel/dp/test_horovod.py`` where Horovod is installed.

Launch with ``horovodrun -np N -H localhost:N python -m foldtrain train --dp.strategy horovod ...``
(``foldtrain.distributed`` takes rank and world from Horovod there). Processes started by torchrun
are each a Horovod world of one, exchanging nothing: the engine refuses a Horovod world whose size
differs from the launch's.

With Horovod: the optimizer's gradient hooks all-reduce (average) as backward produces
gradients, every ``backward_passes_per_step`` (= micro-batches per step) passes; ``sync_grads``
waits for them (``synchronize``) and the step runs under ``skip_synchronize``. In the master
precisions the optimizer owns fp32 copies that receive no gradients from backward, so there
the model's half gradients are averaged with ``grouped_allreduce_`` instead. Horovod 0.28 has no
bfloat16 tensors: in ``bf16-master`` the gradients (and the initial broadcast) travel as fp32.

Horovod's optimizer ``zero_grad()`` takes no ``set_to_none`` (torch's does, and
``torch.distributed.checkpoint`` passes it): the wrapped optimizer gets torch's signature back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from foldtrain.errors import DistributedError
from foldtrain.parallel.dp.base import Strategy


class HorovodStrategy(Strategy):
    def __init__(self, state, cfg):
        import horovod.torch as hvd

        hvd.init()
        launched = dist.get_world_size() if dist.is_initialized() else 1
        if hvd.size() != launched:
            raise DistributedError(
                f"--dp.strategy horovod: Horovod's world has {hvd.size()} process(es) but {launched} were launched "
                f"(torchrun's processes do not form a Horovod world); launch with "
                f"`horovodrun -np {launched} -H localhost:{launched} python -m foldtrain train ...`, "
                "or use --dp.strategy allreduce under torchrun"
            )
        super().__init__(state, cfg)
        self.hvd = hvd
        self.dp_rank, self.dp_world = hvd.rank(), hvd.size()
        rows = cfg.train.global_batch // hvd.size()
        if self.master is None:
            micro_batch = cfg.train.micro_batch
            passes = math.ceil(rows / (micro_batch or rows))
            state.optimizer = hvd.DistributedOptimizer(
                self.optimizer,
                named_parameters=self.named_params,
                backward_passes_per_step=passes,
                # --dp.compression fp16: Horovod's own (validated: it has no bf16 compressor)
                compression=hvd.Compression.fp16 if cfg.dp.compression == "fp16" else hvd.Compression.none,
            )
            _torch_zero_grad_signature(state.optimizer)
            # DistributedOptimizer is a new optimizer over the same parameter groups: the schedule must step
            # *it*, or a checkpoint load (which replaces its groups) leaves the learning rate frozen
            state.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, self.schedule)
        with torch.no_grad():
            wire = {n: _wire(p) for n, p in self.named_params}
            hvd.broadcast_parameters(wire, root_rank=0)
            for n, p in self.named_params:
                if wire[n] is not p:
                    p.copy_(wire[n])

    def sync_grads(self) -> None:
        if self.master is None:
            self.optimizer.synchronize()
        else:
            grads = [p.grad for _, p in self.named_params if p.grad is not None]
            wire = [_wire(g) for g in grads]
            self.hvd.grouped_allreduce_(wire, op=self.hvd.Average)
            for g, w in zip(grads, wire):
                if w is not g:
                    g.copy_(w)

    def apply_update(self, grads_finite: bool) -> None:
        if self.master is None:
            with self.optimizer.skip_synchronize():
                super().apply_update(grads_finite)
        else:
            super().apply_update(grads_finite)

    def reduce_scalar(self, value):
        return self.hvd.allreduce(value.detach().float(), op=self.hvd.Average)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor Horovod exchanges for ``t``: itself, or an fp32 copy of a bfloat16 one."""
    return t.float() if t.dtype == torch.bfloat16 else t


def _torch_zero_grad_signature(opt) -> None:
    """Give Horovod's ``zero_grad()`` (no arguments) torch's ``zero_grad(set_to_none=True)`` back,
    keeping Horovod's check that no all-reduce is still pending."""
    horovod_zero_grad = type(opt).zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        if set_to_none:
            horovod_zero_grad(opt)  # checks, then torch's zero_grad() (set_to_none=True)
        else:
            if opt._handles:
                horovod_zero_grad(opt)  # raises Horovod's error
            torch.optim.Optimizer.zero_grad(opt, set_to_none=False)

    opt.zero_grad = zero_grad
