"""Training engines: one rank's step behind one interface (:class:`Engine`).

``build_engine`` picks the engine for a validated config: the pipeline (3D) engine for any
``--parallel.dp/pp/tp`` above 1, else the replicated engine with the ``--dp.strategy`` of the launch.
"""

from __future__ import annotations

import torch.nn as nn

from foldtrain.engine.base import Engine
from foldtrain.engine.replicated import ReplicatedEngine

__all__ = ["Engine", "ReplicatedEngine", "build_engine"]


def build_engine(cfg, model: nn.Module, env, micro_batch: int) -> Engine:
    from foldtrain.schedules.layout import uses_3d_engine

    if uses_3d_engine(cfg):
        from foldtrain.engine.pipeline import PipelineEngine

        return PipelineEngine(model, cfg, env.device, micro_batch)
    from foldtrain.parallel.dp import strategy_for

    return ReplicatedEngine(model, cfg, env.device, micro_batch, strategy_for(cfg, env.world_size))
