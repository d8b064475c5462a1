"""Data-parallel strategies (``--dp.strategy``), each a :class:`Strategy` overriding only the hooks it needs.

================  ==============================================================================
``none``          one process: the base ``Strategy``
``ddp``           torch ``DistributedDataParallel``: bucketed all-reduce overlapped with backward
``allreduce``     Horovod-style: per-gradient hooks, tensor fusion, async ring all-reduce,
                  optional fp16/bf16 wire compression
``sharded-ps``    every rank serves 1/W of the parameters: reduce-scatter, AdamW on the shard,
                  all-gather (ZeRO-1/2)
``fsdp``          PyTorch FSDP2 (``fully_shard`` per block and on the model): parameters, gradients
                  and AdamW state sharded, each block all-gathered for its forward and backward (ZeRO-3)
``ps``            central parameter server(s), colocated on rank 0 or ``--dp.ps_servers K``
                  dedicated ranks; synchronous, or bounded-staleness asynchronous
                  (``--dp.ps_staleness S``)
``horovod``       Horovod's ``DistributedOptimizer`` (only where Horovod is installed)
``dataparallel``  ``torch.nn.DataParallel``: one process drives the GPUs it sees (HP3C'22's SPS);
                  no process group
================  ==============================================================================

The strategies that span processes measure their traffic and blocked time per step with
:class:`~foldtrain.parallel.dp.comm.CommStats` and turn a dead or stalled peer into a one-line
:class:`~foldtrain.errors.DistributedError` naming it. With one process every strategy but
``dataparallel`` is the single-process ``Strategy`` (there is nobody to communicate with).
"""

from __future__ import annotations

from foldtrain.errors import ConfigError
from foldtrain.parallel.dp.base import DataParallelStrategy, Strategy

__all__ = ["DataParallelStrategy", "Strategy", "strategy_for"]


def strategy_for(cfg, world_size: int) -> type[Strategy]:
    """The strategy class of ``--dp.strategy`` for a launch of ``world_size`` processes."""
    strategy = cfg.dp.strategy
    if strategy == "dataparallel":
        from foldtrain.parallel.dp.dataparallel import TorchDataParallelStrategy

        return TorchDataParallelStrategy
    if world_size == 1 and strategy != "horovod":
        return Strategy
    if strategy == "ddp":
        from foldtrain.parallel.dp.ddp import DDPStrategy as cls
    elif strategy == "allreduce":
        from foldtrain.parallel.dp.allreduce import AllreduceStrategy as cls
    elif strategy == "sharded-ps":
        from foldtrain.parallel.dp.sharded_ps import ShardedPSStrategy as cls
    elif strategy == "fsdp":
        from foldtrain.parallel.dp.fsdp import FSDPStrategy as cls
    elif strategy == "ps" and cfg.dp.ps_staleness > 0:
        from foldtrain.parallel.dp.ps_async import AsyncParameterServerStrategy as cls
    elif strategy == "ps":
        from foldtrain.parallel.dp.ps import ParameterServerStrategy as cls
    elif strategy == "horovod":
        from foldtrain.parallel.dp.horovod import HorovodStrategy as cls
    else:
        raise ConfigError(
            f"--dp.strategy {strategy} cannot run {world_size} processes; choose ddp, allreduce, sharded-ps, fsdp or ps"
        )
    return cls
