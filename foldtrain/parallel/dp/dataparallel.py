"""``--dp.strategy dataparallel``: ``torch.nn.DataParallel``, one process driving every GPU it sees.

HP3C'22's "single parameter server" (SPS) baseline as the paper ran it. Every forward replicates the
model from GPU 0 onto the others, scatters the micro-batch's rows over them, runs the replicas in one
thread each, and gathers their logits on GPU 0, where the loss is computed over the whole micro-batch.
Autograd then scatters the logits' gradient back, and each replica's parameter gradients are summed
onto GPU 0's parameters (``reduce_add``). The clip and the optimizer step run on GPU 0 alone. The
devices are ``--parallel.dp`` of them if given, else every visible one (config validation refuses
more than are visible, and refuses a torchrun launch).

Without CUDA devices ``nn.DataParallel`` calls the module directly, so on a CPU this strategy is the
single-process step through the same wrapper.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from foldtrain.parallel.dp.base import Strategy


class AutocastReplica(nn.Module):
    """The model under the run's autocast, entered by each replica's own thread. ``DataParallel``'s worker
    threads re-enter autocast with only the enabled flag, and the autocast dtype is thread-local, so a
    bf16 run's replicas would compute in torch's default fp16."""

    def __init__(self, model: nn.Module, precision):
        super().__init__()
        self.model = model
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.precision.forward_context():
            return self.model(x)


def device_ids(cfg, visible: int) -> list[int]:
    """The GPUs the run drives: the first ``--parallel.dp`` of the ``visible`` ones if given, else all."""
    return list(range(cfg.parallel.dp if cfg.parallel.dp > 1 else visible))


class TorchDataParallelStrategy(Strategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        # validation admits only CUDA runs; on a machine without CUDA DataParallel ignores device_ids (None)
        # and calls the replica directly, which is how the tests run this path on a CPU
        ids = device_ids(cfg, torch.cuda.device_count()) if self.device.type == "cuda" else None
        self.wrapped = nn.DataParallel(AutocastReplica(self.model, self.precision), device_ids=ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapped(x)
