"""Every check on a config that needs no data and no process group, in one place: one-line
:class:`~foldtrain.errors.ConfigError` naming the problem and the fix."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

from foldtrain.config.schema import (
    AC_MODES,
    COMPRESSIONS,
    DEVICES,
    DP_SYNCS,
    PRECISIONS,
    SCHEDULES,
    SHARD_COLLECTIVES,
    STRATEGIES,
    Config,
)
from foldtrain.errors import ConfigError


def _choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"--{key} '{value}' is not valid; choose one of: {', '.join(valid)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(
            f"--{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}; "
            f"give a {'non-negative' if allow_zero else 'positive'} value"
        )


def parse_signals(spec: str) -> list[signal.Signals]:
    """``"TERM,USR1"`` -> the signals; one-line ConfigError for an unknown or uncatchable name."""
    out = []
    for name in filter(None, (n.strip().upper() for n in spec.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None) if full.isidentifier() else None
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"--checkpoint.signals: '{name}' is not a signal a process can handle; "
                "give names like TERM,USR1,USR2,INT,HUP"
            )
        out.append(sig)
    if not out:
        raise ConfigError(
            "--checkpoint.signals is empty; give names like TERM,USR1 or set --checkpoint.on_signal false"
        )
    return out


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Every check on values that needs no data or process group. Raises ConfigError."""
    m, t, o, d, p = cfg.model, cfg.train, cfg.optim, cfg.dp, cfg.parallel
    for key in ("n_layer", "n_head", "d_model", "context", "vocab_size"):
        _positive(f"model.{key}", getattr(m, key))
    _positive("model.vocab_multiple", m.vocab_multiple)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"--model.dropout must be in [0, 1), got {m.dropout}")
    if m.d_model % m.n_head:
        raise ConfigError(
            f"--model.d_model {m.d_model} is not divisible by --model.n_head {m.n_head}; pick sizes where it is"
        )
    for key in ("steps", "global_batch", "seq_len", "log_every", "eval_batches"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("micro_batch", "eval_every", "sample_tokens", "stop_at"):
        _positive(f"train.{key}", getattr(t, key), allow_zero=True)
    if t.seq_len > m.context:
        raise ConfigError(
            f"--train.seq_len {t.seq_len} is larger than the model's context {m.context}; "
            "lower --train.seq_len or raise --model.context"
        )
    _choice("train.device", t.device, DEVICES)
    _positive("optim.lr", o.lr)
    _positive("optim.min_lr", o.min_lr, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("checkpoint.signal_timeout_s", cfg.checkpoint.signal_timeout_s, allow_zero=True)
    if cfg.checkpoint.on_signal:
        parse_signals(cfg.checkpoint.signals)
    _positive("data.vocab_size", cfg.data.vocab_size)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"--data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    for key in ("workers", "shard_mb", "tokenizer_sample_mb", "num_shards"):
        _positive(f"data.{key}", getattr(cfg.data, key))
    if not 0 <= cfg.data.shard < cfg.data.num_shards:
        raise ConfigError(
            f"--data.shard {cfg.data.shard} is not in [0, --data.num_shards {cfg.data.num_shards}); "
            "number the parts 0 .. num_shards-1"
        )
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("ac", cfg.ac, AC_MODES)
    _choice("dp.strategy", d.strategy, STRATEGIES)
    _choice("dp.compression", d.compression, COMPRESSIONS)
    _choice("dp.shard_collective", d.shard_collective, SHARD_COLLECTIVES)
    _positive("dp.ps_servers", d.ps_servers, allow_zero=True)
    _positive("dp.ps_staleness", d.ps_staleness, allow_zero=True)
    _positive("dp.fusion_mb", d.fusion_mb)
    _positive("dp.first_bucket_mb", d.first_bucket_mb)
    _positive("dp.cycle_ms", d.cycle_ms, allow_zero=True)
    _positive("dp.bucket_mb", d.bucket_mb)
    _positive("dp.shard_bucket_mb", d.shard_bucket_mb)
    _positive("dp.shard_slice_mb", d.shard_slice_mb)
    _positive("dp.shard_budget_mb", d.shard_budget_mb, allow_zero=True)
    _positive("dp.timeout_s", d.timeout_s)
    _positive("fold.bucket_mb", cfg.fold.bucket_mb)
    for key in ("dp", "pp", "tp", "virtual"):
        _positive(f"parallel.{key}", getattr(p, key))
    _positive("parallel.microbatches", p.microbatches, allow_zero=True)
    _choice("parallel.schedule", p.schedule, SCHEDULES)
    _choice("parallel.dp_sync", p.dp_sync, DP_SYNCS)
    if world_size is not None:
        validate_world(cfg, world_size)
    return cfg


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the launch's world size; run on every rank before any collective."""
    d, t = cfg.dp, cfg.train
    if cfg.model.init_from and not cfg.resume and not Path(cfg.model.init_from).expanduser().exists():
        raise ConfigError(
            f"--model.init_from {cfg.model.init_from} does not exist; "
            "pass a Hugging Face GPT-2 directory or a foldtrain model.safetensors"
        )
    if d.strategy == "horovod" and importlib.util.find_spec("horovod") is None:
        raise ConfigError(
            "--dp.strategy horovod needs Horovod, which is not installed "
            "(build it with bash scripts/install-horovod.sh); "
            "or use --dp.strategy allreduce, foldtrain's Horovod-style ring all-reduce"
        )
    if d.strategy == "none" and world_size > 1 and cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp == 1:
        raise ConfigError(
            f"--dp.strategy none runs one process but {world_size} were launched; "
            "pick a strategy (e.g. --dp.strategy ddp) or launch one process"
        )
    if d.ps_servers and d.strategy != "ps":
        raise ConfigError("--dp.ps_servers only applies to --dp.strategy ps; remove it or choose ps")
    if d.ps_servers >= world_size and d.strategy == "ps":
        raise ConfigError(
            f"--dp.ps_servers {d.ps_servers} leaves no worker among {world_size} ranks; "
            "use fewer servers or launch more ranks"
        )
    from foldtrain.schedules.layout import uses_3d_engine, validate_layout

    if cfg.optim.shard_tied and not cfg.optim.distributed:
        raise ConfigError(
            "--optim.shard_tied slices the tied embedding's state of the distributed optimizer over --parallel.dp; "
            "add --optim.distributed true, or drop --optim.shard_tied"
        )
    if cfg.optim.distributed and not uses_3d_engine(cfg):
        raise ConfigError(
            f"--optim.distributed shards the 3D engine's optimizer over --parallel.dp, but this run uses "
            f"--dp.strategy {d.strategy} without a --parallel layout; use --dp.strategy sharded-ps or fsdp "
            f"(the optimizer sharded), or --dp.strategy none with --parallel.dp {world_size}"
        )
    check_compression(cfg)
    if d.strategy == "dataparallel":
        check_dataparallel(cfg, world_size)
        return

    if uses_3d_engine(cfg):  # mesh sizes, schedule, chunk split, tensor-parallel divisibility
        validate_layout(cfg, world_size)
        return
    if d.strategy == "fsdp" and d.shard_vocab:
        check_vocab_slices(cfg, world_size)
    workers = dp_workers(cfg, world_size)
    micro = t.micro_batch or max(1, t.global_batch // workers)
    if t.global_batch % (workers * micro):
        raise ConfigError(
            f"--train.global_batch {t.global_batch} is not divisible by data-parallel workers x micro-batch "
            f"({workers} x {micro}); pick a global batch that is a multiple of {workers * micro}"
        )


def check_compression(cfg: Config) -> None:
    """``--dp.compression`` casts the gradients' reductions: the ``allreduce`` and ``ddp`` strategies' buckets,
    ``fsdp``'s reduce-scatters (its policy's ``reduce_dtype``, with or without a layout), Horovod's (fp16 only)
    and the 3D engine's per-chunk all-reduces. Every other path reduces its gradients in their own dtype."""
    from foldtrain.schedules.layout import uses_3d_engine

    d = cfg.dp
    if d.compression == "none":
        return
    three_d = uses_3d_engine(cfg)
    if three_d and d.strategy == "none" and cfg.optim.distributed:
        raise ConfigError(
            f"--dp.compression {d.compression} casts the 3D engine's all-reduces, but --optim.distributed "
            "reduce-scatters the gradients in their own dtype; drop one of the two"
        )
    if d.strategy == "horovod" and d.compression != "fp16":
        raise ConfigError(
            f"--dp.compression {d.compression}: Horovod compresses to fp16 only (hvd.Compression.fp16); "
            "use --dp.compression fp16, or --dp.strategy allreduce for bf16"
        )
    if d.strategy not in ("allreduce", "ddp", "fsdp", "horovod") and not (three_d and d.strategy == "none"):
        raise ConfigError(
            f"--dp.compression {d.compression} applies to --dp.strategy allreduce, ddp, fsdp and horovod and to the 3D "
            f"engine's all-reduces (--dp.strategy none with a --parallel layout), not to --dp.strategy {d.strategy}; "
            "drop --dp.compression or change the strategy"
        )


def check_vocab_slices(cfg: Config, world_size: int) -> None:
    """``--dp.shard_vocab``: every rank needs at least one row of the (padded) vocabulary."""
    from foldtrain.model.presets import padded_vocab, vocab_slice

    m = cfg.model
    rows = padded_vocab(m.vocab_size, m.vocab_multiple, 1)
    if vocab_slice(rows, world_size, world_size - 1)[1] == 0:
        raise ConfigError(
            f"--dp.shard_vocab splits the {rows}-row vocabulary over {world_size} ranks, which leaves the last "
            f"rank none; add --dp.shard_vocab false or use fewer ranks"
        )


def check_dataparallel(cfg: Config, world_size: int) -> None:
    """``--dp.strategy dataparallel`` (``torch.nn.DataParallel``): one process, the CUDA devices it sees."""
    p = cfg.parallel
    if world_size > 1:
        raise ConfigError(
            f"--dp.strategy dataparallel is torch.nn.DataParallel, one process driving every GPU, but {world_size} "
            "processes were launched; start one process without torchrun, or use --dp.strategy ddp under torchrun"
        )
    if p.pp * p.tp > 1:
        raise ConfigError(
            f"--dp.strategy dataparallel replicates the whole model on every GPU and cannot be combined with "
            f"--parallel.pp {p.pp} / tp {p.tp}; set them to 1, or use --dp.strategy none with the 3D engine"
        )
    if cfg.train.device == "cpu":
        raise ConfigError(
            "--dp.strategy dataparallel drives CUDA devices but --train.device is cpu; "
            "use --train.device auto or cuda, or --dp.strategy none on the CPU"
        )
    import torch  # here only: the other checks need no torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise ConfigError(
            "--dp.strategy dataparallel needs CUDA devices (torch.nn.DataParallel drives GPUs) but none is visible; "
            "use --dp.strategy none on this machine"
        )
    if p.dp > visible:
        raise ConfigError(
            f"--parallel.dp {p.dp} asks dataparallel for {p.dp} GPUs but {visible} are visible; "
            f"use --parallel.dp {visible} or less (without it: all {visible})"
        )
    dataparallel_rows(cfg, p.dp if p.dp > 1 else visible)


def dataparallel_rows(cfg: Config, devices: int) -> tuple[int, int]:
    """``(forwards per step, rows per device)`` of ``dataparallel`` over ``devices`` GPUs: each forward takes
    ``--train.micro_batch`` rows (default: the whole global batch) and scatters them evenly over the devices."""
    t = cfg.train
    rows = t.micro_batch or t.global_batch
    if t.global_batch % rows or rows % devices:
        raise ConfigError(
            f"--dp.strategy dataparallel scatters each forward's {rows} rows (--train.micro_batch, default the "
            f"global batch {t.global_batch}) over {devices} GPUs; pick a micro-batch that is a multiple of {devices} "
            f"and divides --train.global_batch"
        )
    return t.global_batch // rows, rows // devices


def dp_workers(cfg: Config, world_size: int) -> int:
    """Number of ranks that compute gradients on distinct data (parameter servers excluded)."""
    if cfg.dp.strategy == "dataparallel":
        return 1  # one process computes the whole global batch, scattered over its GPUs
    if cfg.parallel.pp * cfg.parallel.tp > 1 or cfg.parallel.dp > 1:
        return cfg.parallel.dp
    if cfg.dp.strategy == "ps":
        return world_size - cfg.dp.ps_servers
    return world_size
