"""The optimizer side of a pipeline rank: one AdamW and one LR schedule per local chunk.

A chunk steps as soon as its own gradients are reduced (Fold3D's per-chunk reduction, and the
deferred steps of ``--fold.defer_reduce``); the executor decides when (:mod:`foldtrain.schedules.rules`)
and calls :class:`ChunkOptimizers` through the
:class:`~foldtrain.parallel.pipeline.executor.ChunkStepper` protocol.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.optim import WarmupCosine, build_optimizer
from foldtrain.parallel.pipeline.p2p import local_part


class ChunkOptimizers:
    """Per-chunk optimizers and LR schedules, the fp16 verdict and the iteration's gradient norm."""

    def __init__(self, chunks: dict, cfg, precision, topo, device, head_copy, any_deferred: bool, wait_collective):
        """``head_copy``: the last segment's copy of the tied weight (left out of norms: the embedding's
        copy counts the tied weight once), or ``None``; ``wait_collective(work, what)``: a bounded wait."""
        self.chunks = chunks
        self.cfg = cfg
        self.precision = precision
        self.topo = topo
        self.device = device
        self.head_copy = head_copy
        self.any_deferred = any_deferred
        self.wait_collective = wait_collective
        self.schedule = WarmupCosine(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)
        self.optimizers = {s: build_optimizer(list(c.named_parameters()), cfg.optim) for s, c in chunks.items()}
        self.lr_schedulers = {
            s: torch.optim.lr_scheduler.LambdaLR(o, self.schedule) for s, o in self.optimizers.items()
        }
        self.step_ok = True  # this iteration's fp16 verdict (every rank the same)
        self.last_grad_norm = 0.0
        self.early_norms_sq: dict[int, torch.Tensor] = {}  # chunks stepped early: their squared norms

    def _params(self) -> list:
        return [p for s in sorted(self.chunks) for p in self.chunks[s].parameters()]

    def step(self, s: int) -> None:
        if self.step_ok:
            self.optimizers[s].step()
        self.lr_schedulers[s].step()
        self.optimizers[s].zero_grad(set_to_none=True)

    def step_early(self, s: int) -> None:
        self.early_norms_sq[s] = self._chunk_norm_sq(s)
        self.step(s)

    def zero_grad(self) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)

    def _chunk_norm_sq(self, s: int) -> torch.Tensor:
        """Squared gradient norm of local chunk ``s`` (the head's tied copy left out, as in the global norm)."""
        grads = [p.grad for p in self.chunks[s].parameters() if p.grad is not None and p is not self.head_copy]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2

    def before_steps(self) -> None:
        """Once per iteration before the first (non-deferred) optimizer step: fp16 overflow check,
        global gradient norm (all chunks, pipeline and TP ranks; the tied weight counted once), clip."""
        params = self._params()
        scaler = self.precision.scaler
        if scaler.enabled:
            finite = scaler.unscale_and_check([local_part(p.grad) for p in params if p.grad is not None])
            flag = torch.tensor([1.0 if finite else 0.0], device=self.device)
            collectives.all_reduce(flag, op=dist.ReduceOp.MIN)
            self.step_ok = bool(flag.item() > 0)
        if self.any_deferred and self.cfg.optim.grad_clip == 0:
            # the deferred chunks' gradients of this iteration are not reduced yet: no global norm needed
            self.last_grad_norm = 0.0
            return
        if not self.step_ok:
            return  # overflow: the step is skipped (as in Engine, the logged norm keeps its last value)
        norm = self._global_norm([p for p in params if p is not self.head_copy])
        clip = self.cfg.optim.grad_clip
        if clip > 0:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        g = local_part(p.grad)
                        g.mul_(coef.to(g.device, g.dtype))
        self.last_grad_norm = float(norm)

    def _global_norm(self, norm_params: list) -> torch.Tensor:
        """The gradient norm over every chunk of every pipeline and TP rank, the early-stepped chunks'
        norms (kept before their step) included."""
        device = self.device
        if self.topo.tp > 1:
            from foldtrain.parallel.tensor import grad_norm

            local = grad_norm(norm_params).float()
        else:
            grads = [p.grad for p in norm_params if p.grad is not None]
            local = (
                torch.nn.utils.get_total_norm(grads, foreach=True).float() if grads else torch.zeros((), device=device)
            )
        early = sum(self.early_norms_sq.values(), torch.zeros((), device=device))
        self.early_norms_sq.clear()
        sq = (local**2 + early).reshape(1).to(device)
        if self.topo.pp > 1:
            work = collectives.all_reduce(sq, group=self.topo.pp_group, async_op=True)
            self.wait_collective(work, "all-reduce of the gradient norm over pipeline ranks")
        return sq.sqrt()[0]
