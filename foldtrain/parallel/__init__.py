"""Parallelism applied from outside the model: data-parallel strategies, pipeline and tensor parallel.

``build_engine`` picks the training-step engine for a validated config.
"""

from __future__ import annotations

import torch.nn as nn


def build_engine(cfg, model: nn.Module, env, micro_batch: int):
    from foldtrain.train.engine import Engine

    # --- 3D engine (data x pipeline x tensor parallel): any --parallel.dp/pp/tp above 1
    from foldtrain.schedules.layout import uses_3d_engine

    if uses_3d_engine(cfg):
        from foldtrain.pipeline.engine import PipelineEngine

        return PipelineEngine(model, cfg, env.device, micro_batch)
    # --- end 3D engine

    if cfg.dp.strategy == "none" and env.world_size == 1:
        return Engine(model, cfg, env.device, micro_batch)
    # --- data parallel over the whole launch (--dp.strategy)
    from foldtrain.parallel.dp import build_dp_engine

    return build_dp_engine(cfg, model, env, micro_batch)
