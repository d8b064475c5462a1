"""The 3D-parallel training engine: data x pipeline x tensor parallel, any pipeline schedule.

``PipelineEngine`` is the ``Engine`` for every run with ``--parallel.dp/pp/tp`` above 1:

* layout: :func:`foldtrain.schedules.layout.validate_layout` (micro-batches, layer split) and the
  ``(dp, pp, tp)`` mesh of :mod:`foldtrain.parallel.mesh` (TP innermost, Megatron placement);
* model: this pipeline rank's ``V`` chunks (:mod:`foldtrain.parallel.pipeline.stage`), full-model parameter names,
  Megatron tensor parallelism inside each chunk when ``tp > 1`` (``foldtrain.parallel.tensor``), optional
  activation recomputation (``--ac full``);
* one AdamW and one LR schedule per local chunk, so a chunk can step as soon as its own gradients
  are reduced (Fold3D's per-chunk reduction, and the deferred steps of ``--fold.defer_reduce``);
* the schedule (:func:`foldtrain.schedules.build_schedule`) run by the single
  :class:`~foldtrain.parallel.pipeline.executor.Executor`;
* checkpoint keys and the full model under the single-process names: :mod:`.pipeline_state`.

Numerics: a step is the single-process step on the same global batch with the same micro-batch
size: every micro-batch loss is divided by the micro-batch count ``M``, gradients averaged over
data-parallel ranks, the tied embedding / output-projection gradients summed over their two
copies, then one global-norm clip and AdamW. In fp32 it matches the single-process ``ReplicatedEngine`` to rounding.
``bf16`` / ``fp16`` autocast work (fp16 with the dynamic ``LossScaler``: one overflow decision over
all ranks, every chunk skips together). In the ``*-master`` modes the chunks hold half-precision weights,
activations travel between stages in that precision, and each chunk's fp32 master copy owns AdamW, the
gradient norm and the checkpoint (:mod:`.pipeline_steps`).

``--profile``: every rank records its actions in a :class:`foldtrain.profile.Timeline` and keeps them;
every 50 steps and at the end of training they are gathered on rank 0 (a collective,
:mod:`foldtrain.profile.recorder`), which appends each step's ``bubble_fraction``,
``all_rank_idle_fraction`` and ``exposed_dp_comm_s`` (longest blocking data-parallel wait) to
``profile.jsonl`` and at the end writes ``timeline.json`` (Chrome trace of the last steps) and
``gantt.png`` into ``--out``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain import collectives
from foldtrain.engine.pipeline_state import ChunkStates
from foldtrain.engine.pipeline_steps import ChunkOptimizers
from foldtrain.errors import ConfigError
from foldtrain.model.gpt import GPT, GPTShape
from foldtrain.optim import Precision
from foldtrain.parallel.mesh import get_topology
from foldtrain.parallel.pipeline import fsdp
from foldtrain.parallel.pipeline.deadlines import DeadlineQueue
from foldtrain.parallel.pipeline.executor import Executor
from foldtrain.parallel.pipeline.p2p import P2P
from foldtrain.parallel.pipeline.reducer import ChunkReducer
from foldtrain.parallel.pipeline.stage import apply_activation_checkpointing, build_chunks, materialize
from foldtrain.parallel.pipeline.tie import LocalTie
from foldtrain.parallel.wire import wire_dtype
from foldtrain.profile import StepProfiler, Timeline
from foldtrain.schedules import channels_of, step_policy
from foldtrain.schedules.layout import tied_halves, validate_layout


def compute_sync(profile: bool, device: torch.device) -> Callable[[], None] | None:
    """With ``--profile`` on a GPU: after each compute action, wait for the compute stream, so that the timeline's
    spans end when the kernels do. Only that stream: ``torch.cuda.synchronize()`` also waits for NCCL's streams,
    where a send completes only when its peer receives and a receive when its peer sends, and the schedules leave
    sends (and rank 0 its receive of the tied copy, posted at the iteration's start) pending across actions: the
    ranks would wait for each other's next actions."""
    if not (profile and device.type == "cuda"):
        return None
    return lambda: torch.cuda.current_stream(device).synchronize()


class PipelineEngine:
    """One rank of a 3D-parallel run (see the module docstring; implements :class:`foldtrain.engine.Engine`)."""

    def __init__(self, model: GPT, cfg, device: torch.device, micro_batch: int | None = None):
        if not dist.is_initialized():
            raise ConfigError("the 3D engine (--parallel.dp/pp/tp) needs a process group; launch with torchrun")
        self.cfg = cfg
        self.device = device
        world = dist.get_world_size()
        self.layout = lay = validate_layout(cfg, world)
        self.micro_batch = lay.micro_batch
        self.precision = Precision(cfg.precision, device)
        self.wire = wire_dtype(cfg.dp.compression, self.precision.param_dtype)  # the chunks' gradients on the link
        self.pipeline_schedule = sched = lay.schedule
        kinds = channels_of(sched) == "per-kind"
        self.topo = topo = get_topology(lay.dp, lay.pp, lay.tp, device.type, cfg.dp.timeout_s, kinds)
        self.rank = topo.rank
        self.dp_rank, self.dp_world = topo.dp_rank, lay.dp
        self.shape: GPTShape = model.shape
        self.n_parts = len(model.parts)
        self.fsdp = cfg.dp.strategy == "fsdp"  # chunks fully sharded over dp (parallel/pipeline/fsdp.py)
        # the full model's parameter names (tied weight once) before the split unties it: checkpoint param_groups
        full_params = [(n, p.dim()) for n, p in model.named_parameters()]

        self.chunks = self._build_chunks(model)
        self.model = nn.ModuleList(self.chunks.values())  # this rank's parameters (names: "<i>.parts....")
        self.named_params = [(n, p) for c in self.chunks.values() for n, p in c.named_parameters()]
        self.split_tie = lay.pp > 1
        # the tied weight copy each end holds when the pipeline splits the tie
        self.tied = {}
        if self.split_tie:
            if 0 in self.chunks:
                self.tied[0] = self.chunks[0].parts["0"].wte.weight
            last = lay.segments - 1
            if last in self.chunks:
                self.tied[last] = self.chunks[last].head.lm_head.weight

        # ---- transport, the optimizer side, executor
        self.iteration = 0
        self._between = False  # an iteration ended whose between-steps work has not started (between_steps)
        self._agreed: int | None = None  # the dp group's largest deferred count, gathered with the loss
        self.shared: list[list[float]] | None = None  # every rank's share() of the last train_step
        self.timeline = Timeline(self.rank, enabled=bool(cfg.profile))
        self.profiler = StepProfiler(self.timeline)
        self.executor = self._build_executor()
        self.steps = self.executor.stepper
        # checkpoint keys and the full model: the single-process names, whatever the layout
        self.states = ChunkStates(
            full_params,
            self.n_parts,
            self.steps,
            self.precision,
            self.topo,
            self.split_tie,
            self.executor,
        )

    def _build_chunks(self, model: GPT) -> dict:
        """This pipeline rank's chunks (global segment -> chunk), materialised, tensor-parallel and
        recomputing as configured."""
        lay, device = self.layout, self.device
        chunks = build_chunks(model, lay.layers, lay.pp, self.topo.pp_rank, self.pipeline_schedule.placement)
        # FSDP keeps fp32 shards and gathers the master precisions' half-precision weights itself
        dtype = torch.float32 if self.fsdp else self.precision.param_dtype
        for c in chunks:  # a model built on the meta device is materialised here, this rank's chunks only
            materialize(c, device, model.init_seed, self.shape.n_layer)
            c.to(device=device, dtype=dtype)
        if lay.tp > 1:
            from foldtrain.parallel.tensor import apply_tensor_parallel

            for c in chunks:
                apply_tensor_parallel(c, self.topo.tp_mesh)
        if self.cfg.ac == "full":
            for c in chunks:
                apply_activation_checkpointing(c)
        if self.fsdp:
            d = self.cfg.dp
            for c in chunks:
                fsdp.shard_chunk(c, self.topo.dp_mesh, d.reshard_after_forward, self.precision, d.compression)
        return {c.segment: c for c in chunks}

    def _build_reducers(self, queue, p2p) -> dict:
        """Each local chunk's data-parallel reduction: the engine's own all-reduce, or FSDP's reduce-scatter."""
        topo, timeout = self.topo, self.cfg.dp.timeout_s
        reducers = {}
        both_ends = len(self.tied) == 2  # zbv: both copies of the tie on this rank
        fsdp_tie = fsdp.LocalShardTie() if both_ends and self.fsdp else None
        local_tie = LocalTie(topo, p2p.wait_collective, self.wire) if both_ends and not self.fsdp else None
        for s, c in self.chunks.items():
            if self.fsdp:
                reducers[s] = fsdp.FSDPChunkReducer(s, c, self.tied.get(s), topo, p2p.wait_collective, fsdp_tie)
                continue
            reducers[s] = ChunkReducer(
                s, list(c.parameters()), self.tied.get(s), topo, timeout, p2p.cpu_timeout, queue, local_tie, self.wire
            )
            if reducers[s].tie is not None:  # the tie's exchange: message sizes from the tokens of a global batch
                reducers[s].tie.set_tokens(self.cfg.train.global_batch * self.cfg.train.seq_len)
        return reducers

    def _build_executor(self) -> Executor:
        """The deadline queue, transport, per-chunk reducers and optimizers this rank's executor drives."""
        cfg, lay, topo, timeout = self.cfg, self.layout, self.topo, self.cfg.dp.timeout_s
        policy = step_policy(cfg.optim.grad_clip > 0, self.precision.scaler.enabled, lay.tp)
        queue = None
        if lay.dp > 1 and not self.fsdp:  # deadline-ordered reductions: a second dp group when any chunk is deferred
            defer = cfg.fold.defer_reduce and lay.virtual > 1
            queue = DeadlineQueue(topo, self.timeline, cfg.fold.bucket_mb * 2**20, timeout, defer, self.wire)
            queue.hold_back(policy.hold_deferred)
        p2p = P2P(
            topo, timeout, self.device, pump=queue.pump if queue is not None and queue.group is not None else None
        )
        reducers = self._build_reducers(queue, p2p)
        stepper = ChunkOptimizers(
            self.chunks,
            cfg,
            self.precision,
            topo,
            self.device,
            self.tied,
            self.tied.get(lay.segments - 1),
            self.pipeline_schedule.deferred_chunks(topo.pp_rank),
            p2p.wait_collective,
            tied_halves=tied_halves(cfg, policy),
        )
        for s, r in reducers.items():  # the distributed optimizer: chunks reduce-scatter into their slices
            r.shards = stepper.shards[s] if stepper.shards else None
            if r.shards is not None and r.tie is not None and r.shards.tied_slice is not None:
                r.tie.share_slices(r.shards.tied_slice)  # the tied copy sliced too: only its slice exchanged
        if lay.tp > 1:
            from foldtrain.parallel.tensor import tp_loss as loss_fn
        else:
            from foldtrain.model.gpt import lm_loss as loss_fn
        return Executor(
            chunks=self.chunks,
            n_segments=lay.segments,
            topo=topo,
            p2p=p2p,
            reducers=reducers,
            stepper=stepper,
            policy=policy,
            queue=queue,
            precision=self.precision,
            loss_fn=loss_fn,
            act_dtype=self.precision.param_dtype,  # half in the master precisions, as the model computes
            d_model=self.shape.d_model,
            timeline=self.timeline,
            sync=compute_sync(self.cfg.profile, self.device),
            rank_of=self.pipeline_schedule.rank_of,
            gather_for_backward=fsdp.unshard if self.fsdp else None,
        )

    @property
    def last_grad_norm(self) -> float:
        return self.steps.last_grad_norm

    @property
    def schedule(self):
        """The learning-rate schedule (a multiplier of ``--optim.lr`` by iteration)."""
        return self.steps.schedule

    # ------------------------------------------------------------------ the step
    def batch(self, sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel replica's rows of the global batch of ``step``."""
        return sampler.rank_batch(step, self.cfg.train.global_batch, self.dp_rank, self.dp_world)

    @property
    def lr(self) -> float:
        return self.cfg.optim.lr * self.schedule(self.iteration)

    def _split(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
        lay = self.layout
        if x.shape[0] != lay.microbatches * lay.micro_batch:
            raise ConfigError(
                f"the 3D engine expected {lay.microbatches * lay.micro_batch} rows per data-parallel rank "
                f"({lay.microbatches} micro-batches of {lay.micro_batch}), got {x.shape[0]}"
            )
        return list(x.split(lay.micro_batch)), list(y.split(lay.micro_batch))

    def train_step(self, x: torch.Tensor, y: torch.Tensor, share: Callable[[], list[float]] | None = None) -> float:
        self.between_steps()  # a caller that does not call it: the last step's deferred buckets go out now
        self.shared = None
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        xs, ys = self._split(x, y)
        self.steps.step_ok = True
        step = self.iteration + 1  # the trainer's numbering (metrics.jsonl, profile.jsonl)
        self.timeline.begin_step(step)
        loss_sum = self.executor.run(self.pipeline_schedule, xs, ys)
        self.timeline.end_step(step)
        self.precision.scaler.update(self.steps.step_ok)
        self.iteration += 1
        # every rank has finished the iteration (its urgent reductions too)
        loss = self._global_loss(loss_sum, share, self.executor.deferred_count())
        self._between = True
        if self.cfg.profile:
            self._profile_step()
        return loss

    def between_steps(self) -> None:
        """Start what runs between two iterations: the deferred buckets held back until every rank finished
        (:meth:`Executor.end_iteration`). The training loop calls it once it has logged the step (its stop vote
        and memory figures came with the loss, ``share``), so that nothing of the loop's queues behind those
        buckets on a slow link (15-50 ms a step at 1 Gbit/s, fold with deferral, when it did). Every method
        that needs the iteration closed (the next ``train_step``, ``flush``) calls it first."""
        if self._between:
            self._between = False
            agreed, self._agreed = self._agreed, None
            self.executor.end_iteration(agreed)

    def _global_loss(
        self, loss_sum: torch.Tensor, share: Callable[[], list[float]] | None = None, count: int | None = None
    ) -> float:
        """Mean over data-parallel ranks of the last segment's loss, on every rank: one all-reduce, or one all-gather
        that carries every rank's ``share()`` too, into :attr:`shared`, and ``count``, this rank's deferred buckets
        issued (a training step's :meth:`Executor.deferred_count`), whose largest over its dp group the queue's
        agreement takes in :meth:`between_steps` (no collective of its own behind the bytes in flight)."""
        holder = self.pipeline_schedule.rank_of(self.layout.segments - 1)
        contributes = self.topo.pp_rank == holder and self.topo.tp_rank == 0
        t = (
            loss_sum.detach().float() / self.layout.dp if contributes else torch.zeros((), device=self.device)
        ).reshape(1)
        t = t.to(self.device)
        if share is None and count is None:
            collectives.all_reduce(t)
            return float(t[0])
        extra = [] if count is None else [float(count)]
        carried = torch.tensor(extra + (share() if share else []), dtype=torch.float64, device=self.device)
        mine = torch.cat([t.double(), carried])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        collectives.all_gather(every, mine)
        if count is not None:
            self._agreed = int(max(float(every[r][1]) for r in self.topo.dp_peers()))
        if share is not None:
            self.shared = [v[1 + len(extra) :].tolist() for v in every]
        return float(sum(float(v[0]) for v in every))

    def flush(self) -> None:
        """Complete deferred reductions and optimizer steps (``--fold.defer_reduce``)."""
        self.between_steps()
        self.executor.flush()

    def zero_grad(self) -> None:
        self.steps.zero_grad()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of ``batches`` (the same on every rank), forward-only through the pipeline."""
        self.flush()
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            for x, y in batches:
                x, y = x.to(self.device), y.to(self.device)
                xs, ys = list(x.split(self.micro_batch)), list(y.split(self.micro_batch))
                losses = self.executor.forward_only(xs, ys)
                if losses:
                    total += sum(loss * xm.shape[0] for loss, xm in zip(losses, xs)) / x.shape[0]
        finally:
            self.model.train()
            if self.fsdp:  # no backward reshards what the forwards gathered
                for c in self.chunks.values():
                    fsdp.reshard(c)
        return self._global_loss(total / max(len(batches), 1))

    # ------------------------------------------------------------------ profiling
    def _profile_step(self) -> None:
        """Keep the step's events; gather them every ``FLUSH_EVERY`` steps and at the run's end (collectives)."""
        end = min(self.cfg.train.steps, self.cfg.train.stop_at) if self.cfg.train.stop_at else self.cfg.train.steps
        out = Path(self.cfg.out) if self.cfg.out else None
        if self.profiler.after_step() or self.iteration == end:
            self.profiler.flush(out)
        if self.iteration == end and out is not None:
            self.write_profile(out)

    def profile_events(self) -> list[list[dict]]:
        """The kept steps' events per global rank (rank 0 only; empty elsewhere)."""
        return self.profiler.events()

    def write_profile(self, out: Path) -> dict:
        """Rank 0: write ``timeline.json`` and ``gantt.png`` of the kept steps and print the per-step table."""
        lay = self.layout
        title = (
            f"{self.cfg.parallel.schedule} dp={lay.dp} pp={lay.pp} tp={lay.tp} V={lay.virtual} M={lay.microbatches} "
            f"dp_sync={self.cfg.parallel.dp_sync}" + (" defer_reduce" if self.cfg.fold.defer_reduce else "")
        )
        return self.profiler.write(out, title)

    def stats(self) -> dict[str, float]:
        return {}  # --profile's figures go to profile.jsonl, gathered at intervals (foldtrain.profile.recorder)

    # ------------------------------------------------------------------ checkpoint state and the full model
    def state_dict(self) -> dict:
        self.flush()
        return self.states.state_dict(self.iteration)

    def load_state_dict(self, sd: dict) -> None:
        self.iteration = self.states.load_state_dict(sd)

    def extra_state(self) -> dict:
        return {}

    def eval_model(self) -> nn.Module | None:
        """Collective: the full fp32 model with the current weights on global rank 0, None elsewhere."""
        self.flush()
        return self.states.full_model(self.shape, self.device, self.layout.layers)
