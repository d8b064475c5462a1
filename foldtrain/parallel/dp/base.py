"""What a data-parallel strategy is: the hooks a replicated engine calls around its step.

A strategy is composed with a :class:`~foldtrain.optim.TrainState` (the replica's model,
optimizer, LR schedule and precision) and decides how gradients become global and how the
update is applied. :class:`Strategy` itself is the single-process behaviour (``--dp.strategy
none``): no communication. :class:`DataParallelStrategy` adds what every communicating strategy
shares: its place in the process group, the step's communication measurements, the mean of
logged values over ranks, and failures named by rank.

Hooks, in the order the engine's step calls them: ``forward`` (the model call, e.g. DDP's
wrapper), ``loss`` (the mean cross entropy of what ``forward`` returned), ``no_sync`` (accumulation
micro-batches), ``sync_grads``, ``global_finite`` (one loss-scaler verdict for ranks holding different
gradient shards), ``apply_update`` (clip, step, LR schedule), ``reduce_scalar`` (the logged loss),
``zero_grad``; ``flush`` (before the replica's weights are read outside a step). Checkpoint and export:
``model_optim_state`` / ``load_model_optim_state`` / ``eval_model``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain import collectives
from foldtrain.optim import TrainState
from foldtrain.parallel.dp.comm import CommStats
from foldtrain.parallel.failures import is_comm_failure
from foldtrain.parallel.tp_loss import tp_loss


def squared_norm(tensors: list[torch.Tensor], device: torch.device, piece: int = 1 << 18) -> torch.Tensor:
    """Sum of squares of every element, in float64, a ``piece`` of elements at a time: converting a whole
    tensor (e.g. a shard of a large vocabulary's embedding) would hold two float64 copies of it at once."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        for part in t.reshape(-1).split(piece):
            total += part.double().pow(2).sum()
    return total


class Strategy:
    """The single-process strategy; subclasses override the hooks they need."""

    # True where the strategy's own parameters are the fp32 masters of the master precisions (FSDP's
    # mixed precision): the replica's TrainState then keeps one fp32 model and no master copy
    keeps_own_masters = False

    def __init__(self, state: TrainState, cfg):
        self.state = state
        self.cfg = cfg
        self.device = state.device
        self.last_grad_norm = 0.0
        self.dp_rank, self.dp_world = 0, 1  # which rows of the global batch this rank computes

    # the replica's pieces, by name (the state owns them)
    model = property(lambda self: self.state.model)
    named_params = property(lambda self: self.state.named_params)
    precision = property(lambda self: self.state.precision)
    optimizer = property(lambda self: self.state.optimizer)
    lr_scheduler = property(lambda self: self.state.lr_scheduler)
    schedule = property(lambda self: self.state.schedule)
    master = property(lambda self: self.state.master)

    @property
    def lr(self) -> float:
        return self.state.lr

    def batch(self, sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of ``step`` (the data position is just the step)."""
        return sampler.rank_batch(step, self.cfg.train.global_batch, self.dp_rank, self.dp_world)

    def stats(self) -> dict[str, float]:
        """Per-step measurements logged to metrics.jsonl (communication bytes, wait time...)."""
        return {}

    def step_context(self) -> contextlib.AbstractContextManager:
        """Wraps one training step (measurements, failure naming)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the step's hooks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return tp_loss(logits, targets)  # = lm_loss on plain logits; vocab-parallel on sharded ones

    def record_loss(self, loss: torch.Tensor) -> None:
        """Sees each training micro-batch's (detached) loss."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_grads(self) -> None:
        """Make every parameter's .grad the global sum-mean over data-parallel ranks."""

    def global_finite(self, finite: bool) -> bool:
        return finite

    def optimizer_params(self) -> list[torch.Tensor]:
        return self.state.optimizer_params()

    def clip(self, params: list[torch.Tensor]) -> float:
        clip = self.cfg.optim.grad_clip
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        return float(norm)

    def apply_update(self, grads_finite: bool) -> None:
        """Clip and step the optimizer on the (synchronised) gradients, unless they overflowed."""
        if grads_finite:
            self.last_grad_norm = self.clip(self.optimizer_params())
            self.optimizer.step()
            self.state.masters_to_model()
        self.lr_scheduler.step()

    def reduce_scalar(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def eval_loss(self, local_loss) -> float:
        """The validation loss over ranks; ``local_loss()`` computes this rank's mean."""
        return float(self.reduce_scalar(local_loss()))

    def zero_grad(self) -> None:
        self.state.zero_grad()

    def flush(self) -> None:
        """Complete communication left in flight into the next step, so the replica is current."""

    # ------------------------------------------------------------------ checkpoint and export
    def model_optim_state(self) -> dict:
        """The ``model`` and ``optim`` entries of a checkpoint; strategies that shard them override this pair."""
        return self.state.model_optim_state()

    def load_model_optim_state(self, sd: dict) -> None:
        self.state.load_model_optim_state(sd)

    def eval_model(self) -> nn.Module | None:
        """The full model with current weights (fp32 masters if any), for sampling and export."""
        return self.state.owner()


class DataParallelStrategy(Strategy):
    """A strategy over the whole launch's process group."""

    def __init__(self, state: TrainState, cfg):
        super().__init__(state, cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_world = self.rank, self.world
        self.comm = CommStats(self.rank, self.world, cfg.dp.timeout_s, self.device)

    def stats(self) -> dict[str, float]:
        return self.comm.stats()

    @contextlib.contextmanager
    def failures_named(self):
        """Turn a communication error inside the block into one line naming the rank that stopped."""
        step = self.lr_scheduler.last_epoch + 1
        try:
            yield
        except Exception as e:
            if is_comm_failure(e):
                raise self.comm.failure(e, step) from e
            raise

    @contextlib.contextmanager
    def step_context(self):
        self.comm.start_step()
        try:
            with self.failures_named():
                yield
        finally:
            self.comm.end_step()

    def eval_loss(self, local_loss) -> float:
        with self.failures_named():
            return super().eval_loss(local_loss)

    def reduce_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of ``value`` over the ranks that computed one (all of them, unless overridden)."""
        return self.mean_over(value, self.world, contributes=True)

    def mean_over(self, value: torch.Tensor, count: int, contributes: bool) -> torch.Tensor:
        t = value.detach().float().reshape(1).clone() if contributes else torch.zeros(1, device=self.device)
        self.comm.count_all_reduce(t)
        with self.comm.blocked("loss all-reduce"):
            collectives.all_reduce(t)
        return t[0] / count

    def clip_by_global_norm(self, params: list[torch.Tensor], group=None, group_size: int | None = None) -> float:
        """``clip`` for gradients spread over ranks: the squared norms of every rank's part (a DTensor
        gradient's local shard) summed over ``group`` (default: all ranks); each part clipped in place as
        ``clip_grads_with_norm_`` does."""
        size = group_size or self.world
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params) if g is not None]
        sq = squared_norm(grads, self.device).reshape(1)
        if size > 1:
            self.comm.count_all_reduce(sq, size)
            with self.comm.blocked("gradient-norm all-reduce"):
                collectives.all_reduce(sq, group=group)
        norm = sq[0].sqrt().float()
        if self.cfg.optim.grad_clip > 0 and grads:
            torch._foreach_mul_(grads, (self.cfg.optim.grad_clip / (norm + 1e-6)).clamp(max=1.0))
        return float(norm)

    def all_true(self, flag: bool, phase: str) -> bool:
        """Logical AND of ``flag`` over all ranks (one tiny all-reduce)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self.comm.count_all_reduce(t)
        with self.comm.blocked(phase):
            collectives.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())
