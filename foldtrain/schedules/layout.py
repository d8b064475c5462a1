"""The 3D layout (data x pipeline x tensor) of a run, checked before any process group exists.

Torch-free. :func:`validate_layout` raises :class:`~foldtrain.errors.ConfigError` for every
layout that cannot run, with one line naming the problem and the fix, and returns the resolved
:class:`Layout` (micro-batch count and size, the layer split) that the pipeline engine uses.

Terms: ``P`` = ``--parallel.pp`` pipeline ranks, ``V`` = ``--parallel.virtual`` chunks per
pipeline rank, ``S = P * V`` model segments (segment ``s`` on pipeline rank ``s % P`` as its
local chunk ``s // P``), ``M`` micro-batches per data-parallel rank and iteration.

Micro-batches (per data-parallel rank, ``B = global_batch / dp`` rows per iteration):

* ``--parallel.microbatches M`` and ``--train.micro_batch m`` both given: ``M * m * dp`` must
  equal ``--train.global_batch``;
* only ``M``: ``m = B / M``;  only ``m``: ``M = B / m``;
* neither: with a pipeline (``pp > 1``) ``m = 1``, so ``M = B`` (torchtitan's default: the
  most micro-batches, the smallest bubble and 1F1B's lowest activation memory); without a
  pipeline ``M = 1`` (the whole per-rank batch in one forward/backward, as the single-process
  engine does with ``micro_batch 0``).

Layer split: segment 0 also holds the embedding and segment ``S - 1`` the head; every segment
holds at least one transformer block. By default the ``n_layer`` blocks are split evenly, the
remainder going to the earliest segments (7 layers in 4 segments: 2, 2, 2, 1);
``--parallel.layers_per_chunk`` gives explicit counts per segment (global segment order).
"""

from __future__ import annotations

from dataclasses import dataclass

from foldtrain.errors import ConfigError
from foldtrain.schedules.actions import Schedule
from foldtrain.schedules.generators import build_schedule, placement_of
from foldtrain.schedules.rules import StepPolicy, splits_tied_state

__all__ = [
    "Layout",
    "check_fsdp",
    "distributed_optimizer",
    "check_tp",
    "chunk_layers",
    "resolve_microbatches",
    "tied_halves",
    "uses_3d_engine",
    "validate_layout",
]


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    virtual: int
    microbatches: int  # M, per data-parallel rank and iteration
    micro_batch: int  # rows per micro-batch
    layers: tuple[tuple[int, ...], ...]  # block indices (0-based) of each global segment
    schedule: Schedule  # the action lists the 3D engine runs (and the simulator simulates)

    @property
    def segments(self) -> int:
        return self.pp * self.virtual

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


def uses_3d_engine(cfg) -> bool:
    """Whether the run goes through the 3D (pipeline) engine: any parallel dimension above 1 (``--parallel.dp``
    alone is the GPU count of ``--dp.strategy dataparallel``, which runs the replicated engine)."""
    p = cfg.parallel
    return p.pp * p.tp > 1 or (p.dp > 1 and cfg.dp.strategy != "dataparallel")


def chunk_layers(
    n_layer: int, n_chunks: int, layers_per_chunk: list[int] | tuple[int, ...] | None = None
) -> list[list[int]]:
    """Block indices of each of ``n_chunks`` segments, in order; every segment gets at least one block.

    Even split by default, the remainder going to the earliest segments; or explicit counts.
    """
    if n_chunks < 1:
        raise ConfigError(
            f"the model must be cut into at least one segment, got {n_chunks}; "
            f"set --parallel.pp and --parallel.virtual >= 1"
        )
    if layers_per_chunk:
        counts = list(layers_per_chunk)
        if len(counts) != n_chunks:
            raise ConfigError(
                f"--parallel.layers_per_chunk has {len(counts)} entries but the model is cut into {n_chunks} segments "
                f"(pp x virtual); give {n_chunks} counts, one per segment in model order, "
                f"or leave it empty for an even split"
            )
        if any(c < 1 for c in counts):
            i = next(i for i, c in enumerate(counts) if c < 1)
            raise ConfigError(
                f"--parallel.layers_per_chunk gives segment {i} {counts[i]} layers; every segment needs at least one "
                f"transformer block, so give counts >= 1"
            )
        if sum(counts) != n_layer:
            raise ConfigError(
                f"--parallel.layers_per_chunk {','.join(map(str, counts))} sums to {sum(counts)} but the model has "
                f"{n_layer} layers (--model.n_layer); make the counts add up to {n_layer}"
            )
    else:
        if n_chunks > n_layer:
            raise ConfigError(
                f"the model has {n_layer} layers but pp x virtual = {n_chunks} segments would leave a segment empty; "
                f"use at most {n_layer} segments (lower --parallel.pp or --parallel.virtual) or raise --model.n_layer"
            )
        base, extra = divmod(n_layer, n_chunks)
        counts = [base + (1 if i < extra else 0) for i in range(n_chunks)]
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def resolve_microbatches(cfg) -> tuple[int, int]:
    """``(M, micro_batch)`` per data-parallel rank; raises ConfigError when they do not tile the batch."""
    t, p = cfg.train, cfg.parallel
    g, dp = t.global_batch, p.dp
    if g % dp:
        raise ConfigError(
            f"--train.global_batch {g} is not divisible by --parallel.dp {dp}; every data-parallel rank needs "
            f"the same number of rows, so use a multiple of {dp}"
        )
    rows = g // dp
    m_count, m_size = p.microbatches, t.micro_batch
    if m_count and m_size:
        if m_count * m_size * dp != g:
            raise ConfigError(
                f"--parallel.microbatches {m_count} x --train.micro_batch {m_size} x --parallel.dp {dp} = "
                f"{m_count * m_size * dp}, but --train.global_batch is {g}; make the product equal the global batch "
                f"(or give only one of --parallel.microbatches / --train.micro_batch)"
            )
        return m_count, m_size
    if m_count:
        if rows % m_count:
            raise ConfigError(
                f"--parallel.microbatches {m_count} does not divide the {rows} rows each data-parallel rank gets "
                f"(--train.global_batch {g} / --parallel.dp {dp}); pick a divisor of {rows}"
            )
        return m_count, rows // m_count
    if m_size:
        if rows % m_size:
            raise ConfigError(
                f"--train.micro_batch {m_size} does not divide the {rows} rows each data-parallel rank gets "
                f"(--train.global_batch {g} / --parallel.dp {dp}); pick a divisor of {rows}"
            )
        return rows // m_size, m_size
    if p.pp > 1:
        return rows, 1
    return 1, rows


def check_tp(n_head: int, d_model: int, vocab_size: int | None, tp: int) -> None:
    """Raise ``ConfigError`` (one line: problem and fix) unless the model shape splits over ``tp`` ranks.
    ``vocab_size``: the embedding's rows, or None for a configured model (its vocabulary is padded)."""
    if tp < 1:
        raise ConfigError(f"--parallel.tp must be >= 1, got {tp}; give a positive tensor-parallel size")
    if tp == 1:
        return
    if n_head % tp:
        raise ConfigError(
            f"--model.n_head {n_head} is not divisible by --parallel.tp {tp}; "
            f"tensor parallelism gives each rank whole attention heads, "
            f"so pick n_head a multiple of tp or a tp dividing n_head"
        )
    if d_model % tp:
        raise ConfigError(
            f"--model.d_model {d_model} is not divisible by --parallel.tp {tp}; pick d_model a multiple of tp"
        )
    if (4 * d_model) % tp:  # implied by d_model % tp == 0; kept for the MLP width's sake
        raise ConfigError(
            f"the MLP width 4*d_model = {4 * d_model} is not divisible by --parallel.tp {tp}; "
            f"pick d_model a multiple of tp"
        )
    if vocab_size is not None and vocab_size % tp:  # only a model built without GPTShape.from_config's padding
        raise ConfigError(
            f"the embedding's {vocab_size} rows are not divisible by --parallel.tp {tp}; "
            f"build the model with GPTShape.from_config(model_config, tp), which pads them"
        )


def distributed_optimizer(cfg) -> bool:
    """Whether a 3D run of ``cfg`` shards its optimizer over dp (``--optim.distributed``, dp > 1)."""
    return bool(cfg.optim.distributed) and cfg.parallel.dp > 1


def tied_halves(cfg, policy: StepPolicy) -> bool:
    """Whether a 3D run of ``cfg`` under ``policy`` splits the tied copy's optimizer state between the pipeline's
    two ends (:func:`~foldtrain.schedules.rules.splits_tied_state` on the run's settings; the engine and the
    simulator both ask here)."""
    p = cfg.parallel
    return splits_tied_state(
        policy,
        dist_optim=distributed_optimizer(cfg),
        shard_tied=cfg.optim.shard_tied,
        pp=p.pp,
        placement=placement_of(p.schedule),
        defer=bool(cfg.fold.defer_reduce) and p.virtual > 1,
        split=cfg.optim.split_tied,
    )


def check_fsdp(cfg) -> None:
    """What ``--dp.strategy fsdp`` (every chunk fully sharded over dp) cannot be combined with in the 3D engine:
    one ConfigError line each, naming the problem and the fix."""
    if cfg.fold.defer_reduce:
        raise ConfigError(
            "--fold.defer_reduce cannot be combined with --dp.strategy fsdp: FSDP reduce-scatters each chunk's "
            "gradients itself and its next forward all-gathers the stepped shards, so there is no reduction to defer; "
            "drop --fold.defer_reduce or use --dp.strategy none"
        )
    if cfg.optim.distributed:
        raise ConfigError(
            "--optim.distributed cannot be combined with --dp.strategy fsdp: FSDP already shards the optimizer "
            "state (with the parameters and gradients) over --parallel.dp; drop --optim.distributed"
        )


def validate_layout(cfg, world_size: int) -> Layout:
    """Every layout check of the 3D engine that needs no process group; returns the resolved layout.

    Call it on every rank (or once in the launcher) before ``init_process_group``.
    """
    p, m = cfg.parallel, cfg.model
    dp, pp, tp, v = p.dp, p.pp, p.tp, p.virtual
    for key, val in (("dp", dp), ("pp", pp), ("tp", tp), ("virtual", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"--parallel.{key} must be a positive integer, got {val!r}; set it to 1 or more")
    if dp * pp * tp != world_size:
        raise ConfigError(
            f"--parallel.dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} but {world_size} processes were launched; "
            f"launch {dp * pp * tp} processes (torchrun --nproc-per-node {dp * pp * tp}) or change "
            f"--parallel.dp/pp/tp so their product is {world_size}"
        )
    if cfg.dp.strategy not in ("none", "fsdp"):
        raise ConfigError(
            f"--dp.strategy {cfg.dp.strategy} cannot be combined with a --parallel layout "
            f"(dp {dp}, pp {pp}, tp {tp}): the 3D engine does its own data-parallel gradient all-reduce, or FSDP's; "
            f"use --dp.strategy none or fsdp with --parallel.dp N, or --parallel.dp/pp/tp 1 with the strategy"
        )
    if v > 1 and pp == 1:
        raise ConfigError(
            f"--parallel.virtual {v} needs a pipeline (--parallel.pp > 1): several chunks on a single pipeline rank "
            f"only add overhead; set --parallel.virtual 1 or raise --parallel.pp"
        )
    n_micro, micro = resolve_microbatches(cfg)

    schedule = build_schedule(p.schedule, pp, v, n_micro, p.dp_sync, cfg.fold.defer_reduce, distributed_optimizer(cfg))
    if cfg.dp.strategy == "fsdp":
        check_fsdp(cfg)
    check_tp(m.n_head, m.d_model, None, tp)  # the vocabulary is padded to a multiple of tp
    layers = chunk_layers(m.n_layer, pp * v, p.layers_per_chunk or None)
    if cfg.fold.defer_reduce:
        # --optim.grad_clip is fine: the engine completes every reduction (deferred ones too) for the
        # global norm before the first step; the deferred steps stay before their chunks' next forward
        if cfg.precision.startswith("fp16"):
            raise ConfigError(
                f"--fold.defer_reduce cannot be combined with --precision {cfg.precision}: dynamic loss scaling "
                "must skip the step of every chunk together when any gradient overflows; "
                "use --precision bf16 or drop --fold.defer_reduce"
            )
    return Layout(dp, pp, tp, v, n_micro, micro, tuple(tuple(x) for x in layers), schedule)
