"""What the simulator needs to know about a run: the layout, the model shape and the precision.

:func:`resolve_setup` turns a validated :class:`foldtrain.config.Config` into a :class:`Setup`
with the same rules as ``foldtrain train``: the 3D engine's layout (``validate_layout``) when
any of ``--parallel.dp/pp/tp`` is above 1 with ``--dp.strategy none``, or ``--parallel.pp/tp`` with ``fsdp``
(every chunk sharded over dp: :mod:`.pipeline_fsdp`); otherwise the
data-parallel engines, where ``--parallel.dp`` is the number of data-parallel workers (plus
``--dp.ps_servers`` dedicated servers; with ``dataparallel``, the GPUs of its one process, each
``micro_batch`` rows of a forward's) and ``--parallel.pp/tp`` must stay 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from foldtrain.config import dataparallel_rows
from foldtrain.errors import ConfigError
from foldtrain.model.presets import padded_vocab
from foldtrain.schedules import step_policy
from foldtrain.schedules.layout import (
    chunk_layers,
    distributed_optimizer,
    resolve_microbatches,
    tied_halves,
    validate_layout,
)

# precision -> (compute dtype, weight bytes, grad bytes, activation bytes, fp32 master copy)
PRECISION = {
    "fp32": ("fp32", 4, 4, 4, False),
    "bf16": ("bf16", 4, 4, 2, False),
    "fp16": ("fp16", 4, 4, 2, False),
    "bf16-master": ("bf16", 2, 2, 2, True),
    "fp16-master": ("fp16", 2, 2, 2, True),
}


@dataclass(frozen=True)
class Setup:
    mode: str  # "3d" (pipeline engine) or "dp" (a --dp.strategy engine, or one process)
    # the 3D engine's reduction: "allreduce-3d" (its per-chunk all-reduce) or "fsdp-3d" (chunks sharded by
    # FSDP2: .pipeline_fsdp); else --dp.strategy
    strategy: str
    dp: int  # data-parallel workers
    servers: int  # dedicated parameter-server ranks (ps only)
    pp: int
    tp: int
    virtual: int
    microbatches: int
    micro_batch: int
    seq: int
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    context: int
    layers: tuple[int, ...]  # transformer blocks per global segment
    dtype: str
    weight_bytes: int
    grad_bytes: int
    act_bytes: int
    master: bool
    ac: bool
    schedule: str
    dp_sync: str
    defer: bool
    staleness: int
    bucket_bytes: float
    fusion_bytes: float
    wire_factor: float  # --dp.compression (allreduce, ddp, fsdp, the 3D engine): wire bytes per gradient byte
    fp16_scaler: bool
    clip: bool
    first_bytes: float = 2**20  # allreduce / sharded-ps: the first bucket's size
    shard_bytes: float = 4 * 2**20  # sharded-ps: the other buckets' size
    slice_bytes: float = 2**20  # sharded-ps: a bucket's reduce-scatter goes in slices of this size
    budget_bytes: float = 0.0  # sharded-ps: --dp.shard_budget_mb (0: one bucket, the largest)
    fold_bucket_bytes: float = 2 * 2**20  # 3D with --fold.defer_reduce: deferred reductions go in buckets of this size
    cycle_s: float = 0.0  # allreduce: Horovod's cycle time (a bucket also closes this long after the last launch)
    # Megatron's scatter/gather: each TP rank sends 1/tp of an activation (not foldtrain's executor)
    p2p_scatter: bool = False
    attention: str = "flash"  # foldtrain's SDPA; "unfused" for other systems' runs (two products, a softmax)
    # a fused attention kernel's speed relative to the cluster's (FlashAttention-2's) figures: other systems'
    # older kernels (foldtrain.sim.validation.gpu.ATTENTION_SPEED)
    attention_speed: float = 1.0
    dropout: bool = False  # --model.dropout > 0: dropout kernels in every block
    seq_parallel: bool = False  # Megatron's sequence parallelism (other systems' runs): norms split over tp
    selective: bool = False  # selective recomputation of the attention core (other systems' runs)
    # foldtrain's own model (foldtrain.model.gpt: biases, q/k/v views, autocast over fp32 weights); other
    # systems' runs: False (foldtrain.sim.ops says what differs)
    native: bool = True
    reshard_after_forward: bool = True  # fsdp: --dp.reshard_after_forward
    # fsdp: when a unit's backward all-gather is issued: "pre", as the unit before it starts its backward
    # (FSDP2's explicit prefetch, foldtrain's), or "post", once that unit's backward is done (FSDP1's
    # BackwardPrefetch.BACKWARD_POST, other systems' runs)
    backward_prefetch: str = "pre"
    # the 3D engine's --optim.distributed with dp > 1: AdamW and fp32 masters on a 1/dp slice of each chunk,
    # the chunk's weights all-gathered over dp after its step
    dist_optim: bool = False
    shard_tied: bool = False  # --optim.shard_tied: the tied copies' state sliced over dp too
    # the distributed optimizer splits the tied copies' state between the pipeline's two ends, each stepping half and
    # all-gathering the halves over the pair (schedules.splits_tied_state, as the engine)
    tied_halves: bool = False
    shard_vocab: bool = False  # fsdp without a layout, --dp.shard_vocab: the tied weight split by rows, never gathered
    # the training loop's own small collectives over every rank after a step's loss all-reduce, per step: the
    # stop agreement (--checkpoint.on_signal) and, on logged steps, the memory gather (foldtrain.train.trainer);
    # the 3D engine carries both in its loss all-gather (none of its own)
    loop_meetings: float = 0.0

    @property
    def optim_share(self) -> float:
        """The fraction of a chunk's parameters whose AdamW state (and masters) a rank holds and steps."""
        sharded = self.dist_optim or self.strategy in ("sharded-ps", "fsdp-3d")
        return 1.0 / self.dp if self.dp > 1 and sharded else 1.0

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp + self.servers

    @property
    def shard_buffer(self) -> float:
        """``sharded-ps``: the replica's gradients and slice buffers a rank holds before its backward waits
        for the link: the largest bucket (``--dp.shard_bucket_mb``, or a gradient bigger than that, alone:
        the embedding, a 4d x d matrix), or ``--dp.shard_budget_mb`` if larger."""
        return max(
            self.shard_bytes,
            self.vocab * self.d_model / self.tp * self.grad_bytes,
            4 * self.d_model * self.d_model / self.tp * self.grad_bytes,
            self.budget_bytes,
        )

    @property
    def segments(self) -> int:
        return self.pp * self.virtual

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.microbatches * self.micro_batch * self.seq


def _dp_strategy(cfg) -> str:
    """The strategy the simulator models (Horovod as allreduce: the same ring all-reduce with fusion);
    ConfigError for a strategy that cannot run with this layout."""
    p, d = cfg.parallel, cfg.dp
    strategy = "allreduce" if d.strategy == "horovod" else d.strategy
    if strategy not in ("none", "fsdp") and p.pp * p.tp > 1:
        raise ConfigError(
            f"--dp.strategy {d.strategy} cannot be combined with --parallel.pp {p.pp} / tp {p.tp}: "
            "the 3D engine does its own data-parallel all-reduce; "
            "use --dp.strategy none with --parallel.dp N, or pp = tp = 1 with the strategy"
        )
    if d.ps_servers and strategy != "ps":
        raise ConfigError("--dp.ps_servers only applies to --dp.strategy ps; remove it or choose ps")
    return strategy


def _pipeline_shape(cfg, full_check: bool) -> tuple[int, int, int, tuple[int, ...]]:
    """The 3D engine's ``(micro-batches, micro-batch, virtual stages, blocks per segment)``, from the
    validated layout (``full_check``) or resolved directly."""
    p = cfg.parallel
    if full_check:
        lay = validate_layout(cfg, p.dp * p.pp * p.tp)
        return lay.microbatches, lay.micro_batch, lay.virtual, tuple(len(x) for x in lay.layers)
    n_micro, micro = resolve_microbatches(cfg)
    layers = tuple(len(x) for x in chunk_layers(cfg.model.n_layer, p.pp * p.virtual, p.layers_per_chunk or None))
    return n_micro, micro, p.virtual, layers


def _dp_shape(cfg, strategy: str) -> tuple[int, int]:
    """A data-parallel engine's (or one process's) ``(micro-batches, micro-batch)`` per worker."""
    t, workers = cfg.train, cfg.parallel.dp
    if strategy == "dataparallel":  # one process: each forward's rows scattered over the devices
        return dataparallel_rows(cfg, workers)
    if strategy == "none" and workers > 1:
        raise ConfigError(
            f"--parallel.dp {workers} needs a data-parallel strategy or the 3D engine; this should not happen"
        )
    micro = t.micro_batch or max(1, t.global_batch // workers)
    if t.global_batch % (workers * micro):
        raise ConfigError(
            f"--train.global_batch {t.global_batch} is not divisible by data-parallel workers x micro-batch "
            f"({workers} x {micro}); pick a global batch that is a multiple of {workers * micro}"
        )
    return t.global_batch // (workers * micro), micro


def resolve_setup(cfg, full_check: bool = True) -> Setup:
    """The simulated run of ``cfg`` (a resolved, validated Config); ConfigError for a layout that cannot run.

    ``full_check=False`` (the planner, whose candidates are valid by construction) skips building
    the schedule once more for validation."""
    p, m, t, d = cfg.parallel, cfg.model, cfg.train, cfg.dp
    dtype, wb, gb, ab, master = PRECISION[cfg.precision]
    strategy = _dp_strategy(cfg)
    # fsdp with a pipeline or tensor parallelism runs in the 3D engine, every chunk sharded over dp
    three_d = (strategy == "none" and p.dp * p.pp * p.tp > 1) or (strategy == "fsdp" and p.pp * p.tp > 1)
    if three_d:
        n_micro, micro, V, layers = _pipeline_shape(cfg, full_check)
        mode, strat = "3d", "fsdp-3d" if strategy == "fsdp" else "allreduce-3d"
    else:
        n_micro, micro = _dp_shape(cfg, strategy)
        V, layers = 1, (len(chunk_layers(m.n_layer, 1)[0]),)
        mode, strat = "dp", strategy if p.dp > 1 else "none"
    compressed = d.compression in ("fp16", "bf16") and gb == 4
    fsdp_wire = strat in ("fsdp", "fsdp-3d") and d.compression != "none"  # reduce_dtype: fp32 reduce-scatters halved
    clip, scaler = cfg.optim.grad_clip > 0, cfg.precision.startswith("fp16")
    return Setup(
        mode=mode,
        strategy=strat,
        dp=p.dp,
        servers=d.ps_servers if strat == "ps" else 0,
        pp=p.pp if three_d else 1,
        tp=p.tp if three_d else 1,
        virtual=V,
        microbatches=n_micro,
        micro_batch=micro,
        seq=t.seq_len,
        n_layer=m.n_layer,
        d_model=m.d_model,
        n_head=m.n_head,
        vocab=padded_vocab(m.vocab_size, m.vocab_multiple, p.tp if three_d else 1),  # the embedding's rows
        context=m.context,
        layers=layers,
        dtype=dtype,
        weight_bytes=wb,
        grad_bytes=gb,
        act_bytes=ab,
        master=master,
        ac=cfg.ac == "full",
        schedule=p.schedule if three_d else "gpipe",
        dp_sync=p.dp_sync if three_d else "after-flush",
        defer=bool(cfg.fold.defer_reduce) and three_d,
        staleness=d.ps_staleness if strat == "ps" else 0,
        bucket_bytes=d.bucket_mb * 2**20,
        fusion_bytes=d.fusion_mb * 2**20,
        first_bytes=d.first_bucket_mb * 2**20,
        shard_bytes=d.shard_bucket_mb * 2**20,
        slice_bytes=d.shard_slice_mb * 2**20,
        budget_bytes=d.shard_budget_mb * 2**20,
        fold_bucket_bytes=cfg.fold.bucket_mb * 2**20,
        cycle_s=d.cycle_ms * 1e-3,
        wire_factor=0.5 if (strat in ("allreduce", "ddp", "allreduce-3d") and compressed) or fsdp_wire else 1.0,
        fp16_scaler=scaler,
        clip=clip,
        dropout=m.dropout > 0,
        reshard_after_forward=d.reshard_after_forward,
        shard_vocab=strat == "fsdp" and d.shard_vocab,
        dist_optim=three_d and distributed_optimizer(cfg),
        shard_tied=three_d and distributed_optimizer(cfg) and cfg.optim.shard_tied,
        tied_halves=three_d and tied_halves(cfg, step_policy(clip, scaler, p.tp)),
        loop_meetings=float(cfg.checkpoint.on_signal) + 1.0 / t.log_every if mode == "dp" and p.dp > 1 else 0.0,
    )
