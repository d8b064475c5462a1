"""The optimizer side of a pipeline rank: one AdamW and one LR schedule per local chunk.

A chunk steps as soon as its own gradients are reduced (Fold3D's per-chunk reduction, and the
deferred steps of ``--fold.defer_reduce``); the executor decides when (:mod:`foldtrain.schedules.rules`)
and calls :class:`ChunkOptimizers` through the
:class:`~foldtrain.parallel.pipeline.executor.ChunkStepper` protocol.

In the master precisions (``bf16-master``, ``fp16-master``) the chunks compute, communicate and reduce in
half precision, and each chunk has an fp32 copy (its *owner*: same names, same layout, DTensors under TP)
that AdamW steps. A chunk's reduced gradients move to its owner once they are final (``_pull``): the
overflow check, the norm and the clip then work in fp32, as the single-process engine does on its masters.

With ``--optim.distributed`` (and dp > 1) the owner of a chunk is this data-parallel rank's slice of it
(:mod:`foldtrain.parallel.pipeline.zero`): the same hand-over of final gradients, a step of the slice, an
all-gather of the weights; the norm sums every rank's slices.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.optim import WarmupCosine, adamw_state, build_optimizer
from foldtrain.parallel.pipeline import fsdp
from foldtrain.parallel.pipeline.deadlines import deferred_group
from foldtrain.parallel.pipeline.p2p import local_part
from foldtrain.parallel.pipeline.zero import ChunkShards
from foldtrain.schedules.layout import distributed_optimizer


class ChunkOptimizers:
    """Per-chunk optimizers and LR schedules, the fp16 verdict and the iteration's gradient norm."""

    def __init__(
        self,
        chunks: dict,
        cfg,
        precision,
        topo,
        device,
        tied: dict,
        head_copy,
        deferred,
        wait_collective,
        tied_halves=False,
    ):
        """``tied``: segment -> the copy of the tied weight that chunk holds where the pipeline splits the tie;
        ``head_copy``: the last segment's copy (left out of norms: the embedding's copy counts the tied weight
        once), or ``None``; ``deferred``: this rank's chunks whose reduction is deferred into the next
        iteration; ``wait_collective(work, what)``: a bounded wait; ``tied_halves``: the distributed optimizer
        splits the tied copies' state between the pipeline's two ends (``schedules.splits_tied_state``)."""
        self.chunks = chunks
        self.cfg = cfg
        self.precision = precision
        self.topo = topo
        self.device = device
        self.deferred = frozenset(deferred)
        self.any_deferred = bool(self.deferred)
        self.wait_collective = wait_collective
        self.schedule = WarmupCosine(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)
        self.shards = None
        self.fsdp = cfg.dp.strategy == "fsdp"  # the chunks are fully sharded: every norm sums local shards
        if distributed_optimizer(cfg):  # this dp rank's slices own AdamW (ZeRO-1)
            deferred_bytes = cfg.fold.bucket_mb * 2**20  # a deferred chunk's reduction: the deadline queue's buckets
            # the embedding copy's rows (shard_tied) on a group of their own: made on every rank, in the same order
            split = cfg.optim.shard_tied and topo.dp > 1 and topo.pp > 1
            rows = deferred_group(topo, cfg.dp.timeout_s, "rows") if split else None
            self.shards = {
                s: ChunkShards(
                    c,
                    tied.get(s),
                    topo,
                    cfg.optim,
                    head_copy,
                    deferred_bytes if s in self.deferred else None,
                    rows,
                    tied_halves,
                )
                for s, c in chunks.items()
            }
            self.owners, self.pairs, self.head_copy = {}, {}, None
            self.optimizers = {s: z.optimizer for s, z in self.shards.items()}
        else:  # the modules AdamW steps: the chunks themselves, or their fp32 masters (FSDP's shards are fp32)
            self.owners = (
                {s: _fp32_copy(c) for s, c in chunks.items()} if precision.master and not self.fsdp else chunks
            )
            self.pairs = {s: list(zip(chunks[s].parameters(), self.owners[s].parameters())) for s in chunks}
            self.head_copy = next((m for s in chunks for p, m in self.pairs[s] if p is head_copy), None)
            self.optimizers = {
                s: build_optimizer(list(o.named_parameters()), cfg.optim) for s, o in self.owners.items()
            }
        self.lr_schedulers = {
            s: torch.optim.lr_scheduler.LambdaLR(o, self.schedule) for s, o in self.optimizers.items()
        }
        self.step_ok = True  # this iteration's fp16 verdict (every rank the same)
        self.last_grad_norm = 0.0
        self.early_norms_sq: dict[int, torch.Tensor] = {}  # chunks stepped early: their squared norms

    def _record_grads(self) -> list[torch.Tensor]:
        """The gradients the step reads (local parts): the chunks', their masters' or this rank's slices'."""
        if self.shards is not None:
            return [g for s in sorted(self.shards) for g in self.shards[s].grads()]
        return [
            local_part(p.grad) for s in sorted(self.owners) for p in self.owners[s].parameters() if p.grad is not None
        ]

    @torch.no_grad()
    def _pull(self, s: int) -> None:
        """Chunk ``s``'s gradients, final when this is called, move to its owner (masters or slices)."""
        if self.shards is not None:
            self.shards[s].pull()
            return
        if self.owners is self.chunks:
            return
        for p, m in self.pairs[s]:
            if p.grad is not None:
                m.grad, p.grad = p.grad.float(), None

    @torch.no_grad()
    def masters_to_chunks(self, segments=None) -> None:
        """Master precisions: the chunks (all, or ``segments``) take their owners' weights."""
        if self.owners is not self.chunks:
            for s in self.chunks if segments is None else segments:
                for p, m in self.pairs.get(s, ()):
                    p.copy_(m)

    def step(self, s: int, hold_gather: bool = False) -> None:
        self._pull(s)
        if self.step_ok:
            if self.shards is not None:
                self.shards[s].step(hold_gather)  # the slice's step; the weights all-gathered by the next forward
            else:
                self.optimizers[s].step()
                self.masters_to_chunks((s,))
        self.lr_schedulers[s].step()
        self.optimizers[s].zero_grad(set_to_none=True)

    def start_gathers(self, s: int) -> None:
        if self.shards is not None:
            self.shards[s].start_gathers()

    def steps_tied_apart(self, s: int) -> bool:
        return self.shards is not None and self.shards[s].steps_tied_apart and self.step_ok

    def step_tied(self, s: int, queue, deadline: int) -> None:
        self.shards[s].step_tied(queue, deadline)

    def start_rows(self, s: int, ids: list[torch.Tensor]) -> torch.Tensor | None:
        if self.shards is None or s not in self.shards:
            return None
        return self.shards[s].start_rows(ids)

    def gathering(self, s: int, ids: list[torch.Tensor] | None = None) -> bool:
        return self.shards is not None and self.shards[s].pending(ids)

    def weights_ready(self, s: int, ids: list[torch.Tensor] | None = None) -> None:
        if self.gathering(s, ids):
            wait = lambda w: self.wait_collective(w, f"all-gather of chunk {s}'s weights over dp")  # noqa: E731
            self.shards[s].land(wait, ids)

    def step_early(self, s: int, hold_gather: bool = False) -> None:
        self._pull(s)
        self.early_norms_sq[s] = self._chunk_norm_sq(s)
        self.step(s, hold_gather)

    def zero_grad(self) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)
        if self.owners is not self.chunks:
            for c in self.chunks.values():
                c.zero_grad(set_to_none=True)

    def _chunk_norm_sq(self, s: int) -> torch.Tensor:
        """Squared gradient norm of local chunk ``s`` (the head's whole tied copy left out, as in the global norm;
        a half of a split copy counts 1/dp); with slices, this rank's share of it."""
        if self.shards is not None:
            return self.shards[s].norm_sq()
        grads = [p.grad for p in self.owners[s].parameters() if p.grad is not None and p is not self.head_copy]
        if self.fsdp:
            return fsdp.norm_sq(grads, self.device)
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2

    def before_steps(self) -> None:
        """Once per iteration before the first (non-deferred) optimizer step: fp16 overflow check,
        global gradient norm (all chunks, pipeline and TP ranks; the tied weight counted once), clip."""
        for s in self.chunks:  # a deferred chunk's gradients are final here only when the norm waited for them
            if s not in self.deferred or self.cfg.optim.grad_clip > 0:
                self._pull(s)
        grads = self._record_grads()
        scaler = self.precision.scaler
        if scaler.enabled:
            finite = scaler.unscale_and_check(grads)
            flag = torch.tensor([1.0 if finite else 0.0], device=self.device)
            collectives.all_reduce(flag, op=dist.ReduceOp.MIN)
            self.step_ok = bool(flag.item() > 0)
        if self.any_deferred and self.cfg.optim.grad_clip == 0:
            # the deferred chunks' gradients of this iteration are not reduced yet: no global norm needed
            self.last_grad_norm = 0.0
            return
        if not self.step_ok:
            return  # overflow: the step is skipped (as in Engine, the logged norm keeps its last value)
        norm = self._global_norm()
        clip = self.cfg.optim.grad_clip
        if clip > 0:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef.to(g.device, g.dtype))
        self.last_grad_norm = float(norm)

    def _global_norm(self) -> torch.Tensor:
        """The gradient norm over every chunk of every pipeline and TP rank (and data-parallel slice), the
        early-stepped chunks' norms (kept before their step) included."""
        device = self.device
        early = sum(self.early_norms_sq.values(), torch.zeros((), device=device))
        self.early_norms_sq.clear()
        if self.shards is not None or self.fsdp:  # every rank holds a weighted share: one sum over all of them
            sq = (sum((self._chunk_norm_sq(s) for s in sorted(self.chunks)), early)).reshape(1)
            work = collectives.all_reduce(sq, async_op=True)
            self.wait_collective(work, "all-reduce of the gradient norm over every rank's shards")
            return sq.sqrt()[0]
        norm_params = [p for s in sorted(self.owners) for p in self.owners[s].parameters() if p is not self.head_copy]
        if self.topo.tp > 1:
            from foldtrain.parallel.tensor import grad_norm

            local = grad_norm(norm_params).float()
        else:
            grads = [p.grad for p in norm_params if p.grad is not None]
            local = (
                torch.nn.utils.get_total_norm(grads, foreach=True).float() if grads else torch.zeros((), device=device)
            )
        sq = (local**2 + early).reshape(1).to(device)
        if self.topo.pp > 1:
            work = collectives.all_reduce(sq, group=self.topo.pp_group, async_op=True)
            self.wait_collective(work, "all-reduce of the gradient norm over pipeline ranks")
        return sq.sqrt()[0]

    # ------------------------------------------------------------------ checkpoint state
    def state_views(self, weights: bool = True, moments: bool = True) -> tuple[dict, dict]:
        """``(modules, optimizers)`` per local chunk holding the weights of record and AdamW's state under the
        chunk's names: the owners themselves, or (slices) fp32 copies of the chunks and plain AdamWs filled by
        a gather over dp (a collective) with the ``weights`` and the ``moments`` asked for (a load, which
        overwrites both, asks for neither; an export wants the weights alone)."""
        if self.shards is None:
            return self.owners, self.optimizers
        modules, optimizers = {}, {}
        for s, z in sorted(self.shards.items()):
            modules[s] = _fp32_copy(self.chunks[s])
            optimizers[s] = build_optimizer(list(modules[s].named_parameters()), self.cfg.optim)
            if weights or moments:
                z.fill_view(modules[s], optimizers[s] if moments else None, adamw_state)
        return modules, optimizers

    def load_views(self, modules: dict, optimizers: dict) -> None:
        """After a checkpoint was loaded into :meth:`state_views`: the owners and the chunks take it."""
        if self.shards is None:
            self.masters_to_chunks()
            return
        for s, z in self.shards.items():
            z.load_view(modules[s], optimizers[s], adamw_state)


def _fp32_copy(chunk: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of a half-precision chunk (same names and layout; DTensors stay DTensors), no gradients."""
    owner = copy.deepcopy(chunk).float()
    owner.zero_grad(set_to_none=True)
    return owner
