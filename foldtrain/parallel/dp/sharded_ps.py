"""``--dp.strategy sharded-ps``: every rank serves 1/W of the parameters (ZeRO-1/2 style).

Flat layout: all parameters that get weight decay (>= 2-D), then the rest, in model order,
zero-padded to a multiple of the world size W. Rank r owns the slice
``[r*S, (r+1)*S)`` (S = padded / W) and keeps, for that slice only, the fp32 master weights and
the AdamW moments: optimizer memory is 1/W of the single-process engine's.

One step: gradients are packed into the flat buffer (in the model's gradient dtype, half in the
master precisions) and ``reduce_scatter_tensor`` leaves each rank the sum of its slice, divided
by W; the gradient norm for clipping is the square root of the all-reduced sum of every rank's
squared shard norm; the fp16 loss scaler's skip decision is all-reduced (MIN) so every rank
takes the same one; AdamW steps the shard; ``all_gather_into_tensor`` (in the model's dtype)
returns the updated slices to every rank's replica. gloo in torch 2.13 supports both
``reduce_scatter_tensor`` and ``all_gather_into_tensor``, so no emulation is needed.

The shard is held as two tensors, the decay part (a 1 x n row, which ``build_optimizer`` files
under weight decay like the matrices it holds) and the rest, so the AdamW groups are exactly the
single-process ones.

Checkpoint: ``model`` is the full fp32 model under the single-process names (gathered from the
shards, so ``eval``/``generate`` read it like any other checkpoint); ``optim`` holds each rank's
moments under ``shard<r>of<W>``: resuming needs the same world size.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain.optim import adamw_state, load_adamw_state
from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.flat import flatten, unflatten_into

# the names torch 2.12+ prefers (the *_tensor spellings warn as deprecated there)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedPSStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        self.flat_params = decay_first([p for _, p in self.named_params])
        n_decay = sum(p.numel() for p in self.flat_params if p.dim() >= 2)
        self.total = sum(p.numel() for p in self.flat_params)
        self.shard = math.ceil(self.total / self.world)
        self.padded = self.shard * self.world
        lo = self.rank * self.shard
        cut, end = min(max(n_decay, lo), lo + self.shard), min(max(self.total, lo), lo + self.shard)
        self.split = (cut - lo, end - cut)  # elements of this shard with / without weight decay
        full = flatten(self.flat_params, torch.float32, self.padded)
        self.decay_shard = nn.Parameter(full[lo:cut].reshape(1, -1).clone())
        self.plain_shard = nn.Parameter(full[cut:end].clone())
        self.shards = [self.decay_shard, self.plain_shard]
        # the fp32 masters are this rank's shard only
        state.set_optimizer([("decay", self.decay_shard), ("plain", self.plain_shard)], masters=False)

    # ------------------------------------------------------------------ the step's hooks
    def sync_grads(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.flat_params]
        full = flatten(grads, self.precision.param_dtype, self.padded)
        mine = torch.empty(self.shard, dtype=full.dtype, device=full.device)
        self.comm.reduce_scatter(full)
        self.comm.wait(reduce_scatter(mine, full, async_op=True), "reduce-scatter")
        g = mine.float().div_(self.world)
        d, n = self.split
        self.decay_shard.grad = g[:d].view(1, -1)
        self.plain_shard.grad = g[d : d + n]

    def optimizer_params(self) -> list[torch.Tensor]:
        return self.shards

    def global_finite(self, finite: bool) -> bool:
        return self.all_true(finite, "loss-scaler all-reduce") if self.precision.scaler.enabled else finite

    def clip(self, params: list[torch.Tensor]) -> float:
        return self.clip_by_global_norm(params)

    def apply_update(self, grads_finite: bool) -> None:
        super().apply_update(grads_finite)  # clip, AdamW on this shard, LR schedule
        if grads_finite:
            unflatten_into(self._gather(self.precision.param_dtype), self.flat_params)

    def zero_grad(self) -> None:
        super().zero_grad()
        self.model.zero_grad(set_to_none=True)

    def _gather(self, dtype: torch.dtype) -> torch.Tensor:
        """The full flat parameter buffer, every rank's shard all-gathered in ``dtype``."""
        mine = flatten(self.shards, dtype, self.shard)
        full = torch.empty(self.padded, dtype=dtype, device=mine.device)
        self.comm.all_gather(full)
        self.comm.wait(all_gather(full, mine, async_op=True), "all-gather")
        return full

    # ------------------------------------------------------------------ checkpoint and export
    def _fp32_views(self, full: torch.Tensor) -> dict[int, torch.Tensor]:
        """Parameter storage address -> its fp32 values, as views into the full flat buffer ``full``."""
        views, offset = {}, 0
        for p in self.flat_params:
            views[p.data_ptr()] = full[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return views

    def model_optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        views = self._fp32_views(self._gather(torch.float32))
        model = {k: views.get(v.data_ptr(), v) for k, v in get_model_state_dict(self.model).items()}
        optim = {f"shard{self.rank}of{self.world}": {"decay": adamw_state(self.optimizer, self.decay_shard), "plain": adamw_state(self.optimizer, self.plain_shard)}}
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def load_model_optim_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        by_ptr = {v.data_ptr(): sd["model"][k] for k, v in get_model_state_dict(self.model).items()}
        full = flatten([by_ptr[p.data_ptr()] for p in self.flat_params], torch.float32, self.padded)
        lo = self.rank * self.shard
        unflatten_into(full[lo : lo + self.shard], self.shards)
        unflatten_into(full, self.flat_params)
        saved = sd["optim"][f"shard{self.rank}of{self.world}"]
        for key, p in (("decay", self.decay_shard), ("plain", self.plain_shard)):
            load_adamw_state(self.optimizer, p, saved[key])

    def eval_model(self) -> nn.Module:
        if not self.precision.master:
            return self.model
        model = copy.deepcopy(self.model).float()  # collective: every rank gathers the fp32 masters
        unflatten_into(self._gather(torch.float32), decay_first(list(model.parameters())))
        return model


def decay_first(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The flat layout's order: weight-decayed (>= 2-D) parameters, then the rest, each in model order."""
    return [p for p in params if p.dim() >= 2] + [p for p in params if p.dim() < 2]
