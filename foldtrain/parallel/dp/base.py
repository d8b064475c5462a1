"""What every data-parallel strategy shares: its place in the process group, the step's
communication measurements, the mean of logged values over ranks, and failures named by rank."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain.parallel.dp.comm import CommStats, is_comm_failure
from foldtrain.train.engine import Engine


class DataParallelEngine(Engine):
    """``Engine`` over the whole launch's process group; subclasses override the step's hooks."""

    def __init__(self, model: nn.Module, cfg, device: torch.device, micro_batch: int):
        super().__init__(model, cfg, device, micro_batch)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_world = self.rank, self.world
        self.comm = CommStats(self.rank, self.world, cfg.dp.timeout_s)

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

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.comm.start_step()
        try:
            with self.failures_named():
                return super().train_step(x, y)
        finally:
            self.comm.end_step()

    def eval_loss(self, batches) -> float:
        with self.failures_named():
            return super().eval_loss(batches)

    def reduce_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of ``value`` over the ranks that computed one (all of them, unless overridden)."""
        return self.mean_over(value, self.world, contributes=True)

    def mean_over(self, value: torch.Tensor, count: int, contributes: bool) -> torch.Tensor:
        t = value.detach().float().reshape(1).clone() if contributes else torch.zeros(1, device=self.device)
        self.comm.all_reduce(t)
        with self.comm.blocked("loss all-reduce"):
            dist.all_reduce(t)
        return t[0] / count

    def clip_by_global_norm(self, params: list[torch.Tensor], group=None, group_size: int | None = None) -> float:
        """``Engine.clip`` for gradients spread over ranks: the squared norms of every rank's part summed
        over ``group`` (default: all ranks)."""
        size = group_size or self.world
        sq = sum((p.grad.double().pow(2).sum() for p in params if p.grad is not None), torch.zeros((), dtype=torch.float64, device=self.device)).reshape(1)
        if size > 1:
            self.comm.all_reduce(sq, size)
            with self.comm.blocked("gradient-norm all-reduce"):
                dist.all_reduce(sq, group=group)
        norm = sq[0].sqrt().float()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.grad_clip, norm, foreach=True)
        return float(norm)

    def all_true(self, flag: bool, phase: str) -> bool:
        """Logical AND of ``flag`` over all ranks (one tiny all-reduce)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self.comm.all_reduce(t)
        with self.comm.blocked(phase):
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())


# ---------------------------------------------------------------------- helpers for flat buffers
def flatten(tensors: list[torch.Tensor], dtype: torch.dtype, size: int | None = None) -> torch.Tensor:
    """``tensors`` concatenated into one 1-D buffer of ``dtype``, zero-padded to ``size``."""
    parts = [t.detach().reshape(-1).to(dtype) for t in tensors]
    used = sum(p.numel() for p in parts)
    if size is not None and size > used:
        parts.append(torch.zeros(size - used, dtype=dtype, device=parts[0].device if parts else None))
    return torch.cat(parts)


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (casting to their dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``p``'s AdamW state, created (zero moments, step 0) if the optimizer has not stepped yet, so a
    checkpoint can be loaded into it in place."""
    state = optimizer.state[p]
    if not state:
        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    return state


@torch.no_grad()
def load_adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, saved: dict) -> None:
    """Copy a saved AdamW state into ``p``'s (a no-op where DCP already loaded it in place)."""
    state = adamw_state(optimizer, p)
    for name, value in saved.items():
        if value is not state[name]:
            state[name].copy_(value)
