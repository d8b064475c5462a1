"""``--dp.strategy sharded-ps``: ZeRO-2. Every rank keeps 1/W of the gradients and of the optimizer.

:class:`ShardedPSStrategy` coordinates four pieces, each in its own module:

* :mod:`~foldtrain.parallel.dp.shard_layout`: the buckets (``--dp.shard_bucket_mb``, 4 MB, small so
  that the reduce-scatter overlaps the backward and the all-gather the forward), their slices, and the
  piece of each that this rank owns; the rank's ``decay_shard`` and ``plain_shard``, which AdamW steps,
  are its pieces of every bucket;
* :mod:`~foldtrain.parallel.dp.shard_scatter`: during every micro-batch's backward, each bucket's
  reduce-scatter in slices into this rank's fp32 gradient shard, the replica's gradients held to
  one bucket;
* :mod:`~foldtrain.parallel.dp.shard_gather`: after the step, the per-bucket all-gathers of the
  updated shards into the replica, landed by the next forward's pre-hooks;
* :mod:`~foldtrain.parallel.dp.shard_checkpoint`: the full fp32 model and each rank's moments
  under ``shard<r>of<W>``.

The step: the gradient norm for clipping is the square root of the all-reduced sum of every rank's
squared shard norm; the fp16 loss scaler's skip decision is all-reduced (MIN) so every rank takes
the same one; AdamW steps the shard; the all-gathers start.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.dp.comm import nbytes
from foldtrain.parallel.dp.shard_checkpoint import ShardCheckpoint
from foldtrain.parallel.dp.shard_gather import GatherQueue
from foldtrain.parallel.dp.shard_layout import ShardLayout
from foldtrain.parallel.dp.shard_scatter import ReduceScatterPipeline
from foldtrain.parallel.scatter import uses_all_to_all


class ShardedPSStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        d = cfg.dp
        self.params = [p for _, p in self.named_params]
        self.layout = ShardLayout(
            self.params,
            self.world,
            self.rank,
            first_bytes=d.first_bucket_mb * 2**20,
            cap_bytes=d.shard_bucket_mb * 2**20,
            slice_bytes=d.shard_slice_mb * 2**20,
        )
        full = [p.detach().float() for p in self.params]
        self.decay_shard = nn.Parameter(self.layout.my_part(full, "decay").reshape(1, -1))
        self.plain_shard = nn.Parameter(self.layout.my_part(full, "plain"))
        self.shards = [self.decay_shard, self.plain_shard]
        state.set_optimizer(
            [("decay", self.decay_shard), ("plain", self.plain_shard)], masters=False
        )  # fp32 masters: the shard only
        self.scatter = ReduceScatterPipeline(
            self.layout,
            self.params,
            self.comm,
            self.precision.param_dtype,
            budget_bytes=d.shard_budget_mb * 2**20,
            a2a=uses_all_to_all(d.shard_collective),  # the reduce-scatter as an all-to-all + local sum
        )
        self.gathers = GatherQueue(self.layout, self.params, self.decay_shard, self.plain_shard, self.comm, self.model)
        self.checkpoint = ShardCheckpoint(state, self.layout, self.gathers, self.decay_shard, self.plain_shard)

    # what the layout and the backward are made of, by name
    buckets = property(lambda self: self.layout.buckets)
    n_decay = property(lambda self: self.layout.n_decay)  # this rank's shard: decay / plain elements
    n_plain = property(lambda self: self.layout.n_plain)
    total = property(lambda self: self.layout.total)
    budget = property(lambda self: self.scatter.budget)  # bytes of gradients and slice buffers alive at most
    a2a = property(lambda self: self.scatter.a2a)

    # ------------------------------------------------------------------ backward: into the gradient shard
    def _end_backward(self) -> None:
        self.gathers.land_all()  # a module the forward skipped keeps its bucket pending: land it before the next step
        self.scatter.end_backward()

    @contextlib.contextmanager
    def no_sync(self):
        yield  # ZeRO-2 reduces every micro-batch's gradients into the shard: nothing accumulates full-size
        self._end_backward()

    def sync_grads(self) -> None:
        self._end_backward()
        grad = self.scatter.grad_shard
        self.decay_shard.grad = grad[: self.layout.n_decay].view(1, -1)
        self.plain_shard.grad = grad[self.layout.n_decay :]

    # ------------------------------------------------------------------ the update
    def optimizer_params(self) -> list[torch.Tensor]:
        return self.shards

    def global_finite(self, finite: bool) -> bool:
        return self.all_true(finite, "loss-scaler all-reduce") if self.precision.scaler.enabled else finite

    def clip(self, params: list[torch.Tensor]) -> float:
        return self.clip_by_global_norm(params)

    def apply_update(self, grads_finite: bool) -> None:
        super().apply_update(grads_finite)  # clip, AdamW on this shard, LR schedule
        if grads_finite:
            self.gathers.start(self.precision.param_dtype)

    def flush(self) -> None:
        self.gathers.land_all()

    def zero_grad(self) -> None:
        super().zero_grad()
        self.model.zero_grad(set_to_none=True)
        self.scatter.zero()

    def grad_optim_bytes(self) -> tuple[int, int]:
        """(persistent, peak transient) bytes: gradient shard + fp32 shard weights + AdamW state; and
        the most full-size gradients plus bucket buffers alive at once during the step."""
        persistent = sum(nbytes(s) for s in self.shards) + self.scatter.grad_shard_bytes()
        persistent += sum(nbytes(t) for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t))
        return persistent, self.scatter.peak_transient

    def stats(self) -> dict[str, float]:
        persistent, transient = self.grad_optim_bytes()
        return {
            **super().stats(),
            "grad_optim_mem_mb": (persistent + transient) / 2**20,
            "dp_buckets": float(len(self.layout.buckets)),
        }

    # ------------------------------------------------------------------ checkpoint and export
    def model_optim_state(self) -> dict:
        return self.checkpoint.save()

    def load_model_optim_state(self, sd: dict) -> None:
        self.checkpoint.load(sd)

    def eval_model(self) -> nn.Module:
        self.gathers.land_all()
        if not self.precision.master:
            return self.model
        model = copy.deepcopy(self.model).float()  # collective: every rank gathers the fp32 masters
        self.layout.unpack(self.gathers.gather_rows(torch.float32), list(model.parameters()))
        return model
