"""One typed configuration tree, loaded from TOML and the command line, validated in one place.

Every field can be set in a TOML file (``--config FILE``; sections are tables,
top-level fields are top-level keys) and overridden on the command line as
``--section.field value`` (torchtitan's convention); top-level fields are
``--field value``. Booleans may be given as a bare flag (``--resume``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (a dependency there, see pyproject.toml)
    import tomli as tomllib

from foldtrain.errors import ConfigError
from foldtrain.model.hf_config import resolve_init_from
from foldtrain.model.presets import PRESETS

STRATEGIES = ("none", "ps", "sharded-ps", "allreduce", "ddp", "horovod")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-master", "fp16-master")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "fold")
DP_SYNCS = ("after-flush", "per-chunk")
AC_MODES = ("none", "full")
COMPRESSIONS = ("none", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    # 0 means "take the preset's value"
    n_layer: int = 0
    n_head: int = 0
    d_model: int = 0
    context: int = 0
    vocab_size: int = 0
    dropout: float = 0.0
    # a Hugging Face GPT-2 directory or a foldtrain model.safetensors: initial weights, and the shape
    init_from: str = ""


@dataclass
class DataConfig:
    # prepared data directory, or raw input (text file, directory, .jsonl, HF dataset on disk);
    # empty: the built-in default corpus (the running interpreter's standard library source)
    path: str = ""
    # where `foldtrain prepare` writes, and where the default corpus is cached
    out: str = ""
    vocab_size: int = 8192  # BPE vocabulary trained on the corpus
    tokenizer: str = ""  # an existing tokenizer.json instead of training one
    text_field: str = "text"  # JSONL / HF dataset field holding the text
    val_fraction: float = 0.005
    seed: int = 1337
    # prepared datasets blended by weight for training, "DIR=WEIGHT,DIR=WEIGHT" (instead of path)
    mix: str = ""
    verify: bool = False  # check every token file's sha256 on open, even above 1 GiB (smaller: always)
    workers: int = 1  # prepare: processes encoding shards in parallel (1: in this process, all cores)
    shard_mb: float = 256.0  # prepare: input text per shard
    tokenizer_sample_mb: float = 100.0  # prepare: text sampled (seeded) to train the tokenizer
    shard: int = 0  # prepare: which part of the corpus this machine prepares (0 .. num_shards-1)
    num_shards: int = 1  # prepare: parts the corpus is prepared in (one per machine); 1: all of it


@dataclass
class TrainConfig:
    steps: int = 300
    stop_at: int = 0  # end this session after this step (with a checkpoint), e.g. for time-limited jobs; 0: run to steps
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 0  # sequences per forward/backward; 0: the whole per-rank batch
    seq_len: int = 128
    seed: int = 1337
    log_every: int = 1
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8
    sample_tokens: int = 200  # tokens of generated text printed at the end; 0: none
    sample_prompt: str = ""  # text the final sample continues; empty: the start of a document
    device: str = "auto"
    progress: bool = True


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 60  # 20 made the quickstart's loss spike at step 29 (7.0 -> 11.2); see docs/benchmarks.md
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping


@dataclass
class CheckpointConfig:
    every: int = 100  # save every K steps (and always at the end); 0: only at the end
    keep: int = 3  # keep the last N checkpoints
    safetensors: bool = True  # also export the final weights as model.safetensors


@dataclass
class DPConfig:
    strategy: str = "none"
    ps_servers: int = 0  # dedicated parameter-server processes; 0: colocated on rank 0
    ps_staleness: int = 0  # >0: bounded-staleness asynchronous parameter server
    fusion_mb: float = 64.0  # allreduce tensor-fusion threshold
    first_bucket_mb: float = 1.0  # allreduce / sharded-ps: the first bucket closes here (the link starts early)
    cycle_ms: float = 5.0  # allreduce: a bucket also closes this long after the last launch (Horovod's cycle time); 0: off
    compression: str = "none"  # allreduce wire compression: none, fp16, bf16
    bucket_mb: float = 25.0  # ddp bucket size
    timeout_s: float = 120.0  # a rank that stalls this long makes every rank fail


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    virtual: int = 1  # model chunks per pipeline rank
    schedule: str = "1f1b"
    dp_sync: str = "after-flush"
    microbatches: int = 0  # 0: global_batch / (dp * micro_batch)
    layers_per_chunk: list[int] = field(default_factory=list)  # empty: even split


@dataclass
class FoldConfig:
    defer_reduce: bool = False
    bucket_mb: float = 2.0  # deferred chunk reductions travel in buckets of this size, in deadline order


@dataclass
class Config:
    out: str = "runs/default"
    resume: bool = False
    precision: str = "fp32"
    ac: str = "none"
    profile: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fold: FoldConfig = field(default_factory=FoldConfig)


# ---------------------------------------------------------------- keys and types


def all_keys(cfg: Config | None = None) -> list[str]:
    cfg = cfg or Config()
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            keys.append(f.name)
    return keys


def _field_type(obj: Any, name: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    return hints[name]


def _convert(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, with a clear error."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.strip(), 0)
        if typ is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if typ is str:
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
        if origin is list:
            (inner,) = typing.get_args(typ)
            if isinstance(raw, str):
                raw = [p for p in raw.replace(" ", "").split(",") if p]
            if not isinstance(raw, list):
                raise ValueError
            return [_convert(key, r, inner) for r in raw]
        if origin in (typing.Union, types.UnionType):
            raise ValueError
    except (TypeError, ValueError):
        name = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"--{key}: expected {name}, got {raw!r}; give a value of type {name}") from None
    return raw


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"did you mean --{near[0]}?" if near else "run `foldtrain config` to list the valid keys"
    return ConfigError(f"unknown config key '{key}'; {hint}")


def set_value(cfg: Config, key: str, raw: Any) -> None:
    """Set ``section.field`` (or a top-level ``field``) from a raw value."""
    parts = key.split(".")
    keys = all_keys(cfg)
    if key not in keys:
        raise _unknown(key, keys)
    obj = cfg
    for p in parts[:-1]:
        obj = getattr(obj, p)
    setattr(obj, parts[-1], _convert(key, raw, _field_type(obj, parts[-1])))


def load_toml(cfg: Config, path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass an existing TOML file to --config")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid TOML ({e}); fix the syntax") from None
    for k, v in data.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                set_value(cfg, f"{k}.{kk}", vv)
        else:
            set_value(cfg, k, v)


def parse_overrides(args: list[str]) -> list[tuple[str, str | bool]]:
    """``--a.b v``, ``--a.b=v`` and bare boolean flags ``--resume`` into (key, value) pairs."""
    bool_keys = {k for k in all_keys() if _is_bool(k)}
    out: list[tuple[str, str | bool]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise ConfigError(f"unexpected argument '{a}'; options look like --section.field value")
        a = a[2:]
        if "=" in a:
            k, v = a.split("=", 1)
            out.append((k, v))
            i += 1
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        if a in bool_keys and (nxt is None or nxt.startswith("--") or nxt.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off")):
            out.append((a, True))
            i += 1
            continue
        if nxt is None:
            if a not in all_keys():
                raise _unknown(a, all_keys())
            raise ConfigError(f"--{a} needs a value; write --{a} VALUE")
        out.append((a, nxt))
        i += 2
    return out


def _is_bool(key: str) -> bool:
    cfg = Config()
    parts = key.split(".")
    obj = cfg
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return _field_type(obj, parts[-1]) is bool


def build_config(args: list[str] | None = None, config_file: str | None = None, validate_now: bool = True) -> Config:
    """Defaults, then the TOML file, then command-line overrides; presets resolved; validated."""
    cfg = Config()
    if config_file:
        load_toml(cfg, config_file)
    for k, v in parse_overrides(args or []):
        set_value(cfg, k, v)
    resolve(cfg)
    if validate_now:
        validate(cfg)
    return cfg


def resolve(cfg: Config) -> Config:
    """Fill model fields left at 0 from --model.init_from's checkpoint, else from the preset."""
    m = cfg.model
    if m.preset not in PRESETS:
        near = difflib.get_close_matches(m.preset, PRESETS, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(f"unknown model preset '{m.preset}'; {hint}valid presets: {', '.join(PRESETS)}")
    src = resolve_init_from(m, PRESETS, ModelConfig.preset)  # the checkpoint's shape; a conflicting --model.* is an error
    if src is not None and src.kind == "hf" and not cfg.data.tokenizer and not (Path(cfg.data.path).expanduser() / "meta.json").is_file():
        if src.tokenizer is None:
            raise ConfigError(
                f"--model.init_from {m.init_from} has no tokenizer.json, and a BPE trained on your data would give ids the weights do not know; "
                "put the model's tokenizer.json there or pass it with --data.tokenizer FILE"
            )
        cfg.data.tokenizer = str(src.tokenizer)  # fine-tuning a HF model: its own tokenizer encodes the new text
    for k, v in PRESETS[m.preset].items():
        if getattr(m, k) == 0:
            setattr(m, k, v)
    return cfg


def _choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"--{key} '{value}' is not valid; choose one of: {', '.join(valid)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"--{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}; give a {'non-negative' if allow_zero else 'positive'} value")


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Every check on values that needs no data or process group. Raises ConfigError."""
    m, t, o, d, p = cfg.model, cfg.train, cfg.optim, cfg.dp, cfg.parallel
    for key in ("n_layer", "n_head", "d_model", "context", "vocab_size"):
        _positive(f"model.{key}", getattr(m, key))
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"--model.dropout must be in [0, 1), got {m.dropout}")
    if m.d_model % m.n_head:
        raise ConfigError(f"--model.d_model {m.d_model} is not divisible by --model.n_head {m.n_head}; pick sizes where it is")
    for key in ("steps", "global_batch", "seq_len", "log_every", "eval_batches"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("micro_batch", "eval_every", "sample_tokens", "stop_at"):
        _positive(f"train.{key}", getattr(t, key), allow_zero=True)
    if t.seq_len > m.context:
        raise ConfigError(f"--train.seq_len {t.seq_len} is larger than the model's context {m.context}; lower --train.seq_len or raise --model.context")
    _choice("train.device", t.device, DEVICES)
    _positive("optim.lr", o.lr)
    _positive("optim.min_lr", o.min_lr, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("data.vocab_size", cfg.data.vocab_size)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"--data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    for key in ("workers", "shard_mb", "tokenizer_sample_mb", "num_shards"):
        _positive(f"data.{key}", getattr(cfg.data, key))
    if not 0 <= cfg.data.shard < cfg.data.num_shards:
        raise ConfigError(f"--data.shard {cfg.data.shard} is not in [0, --data.num_shards {cfg.data.num_shards}); number the parts 0 .. num_shards-1")
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("ac", cfg.ac, AC_MODES)
    _choice("dp.strategy", d.strategy, STRATEGIES)
    _choice("dp.compression", d.compression, COMPRESSIONS)
    _positive("dp.ps_servers", d.ps_servers, allow_zero=True)
    _positive("dp.ps_staleness", d.ps_staleness, allow_zero=True)
    _positive("dp.fusion_mb", d.fusion_mb)
    _positive("dp.first_bucket_mb", d.first_bucket_mb)
    _positive("dp.cycle_ms", d.cycle_ms, allow_zero=True)
    _positive("dp.bucket_mb", d.bucket_mb)
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
        raise ConfigError(f"--model.init_from {cfg.model.init_from} does not exist; pass a Hugging Face GPT-2 directory or a foldtrain model.safetensors")
    if d.strategy == "horovod" and importlib.util.find_spec("horovod") is None:
        raise ConfigError(
            "--dp.strategy horovod needs Horovod, which is not installed (build it with bash scripts/install-horovod.sh); "
            "or use --dp.strategy allreduce, foldtrain's Horovod-style ring all-reduce"
        )
    if d.strategy == "none" and world_size > 1 and cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp == 1:
        raise ConfigError(f"--dp.strategy none runs one process but {world_size} were launched; pick a strategy (e.g. --dp.strategy ddp) or launch one process")
    if d.ps_servers and d.strategy != "ps":
        raise ConfigError("--dp.ps_servers only applies to --dp.strategy ps; remove it or choose ps")
    if d.ps_servers >= world_size and d.strategy == "ps":
        raise ConfigError(f"--dp.ps_servers {d.ps_servers} leaves no worker among {world_size} ranks; use fewer servers or launch more ranks")
    from foldtrain.schedules.layout import uses_3d_engine, validate_layout

    if uses_3d_engine(cfg):  # mesh sizes, schedule, chunk split, tensor-parallel divisibility
        validate_layout(cfg, world_size)
        return
    workers = dp_workers(cfg, world_size)
    micro = t.micro_batch or max(1, t.global_batch // workers)
    if t.global_batch % (workers * micro):
        raise ConfigError(
            f"--train.global_batch {t.global_batch} is not divisible by data-parallel workers x micro-batch "
            f"({workers} x {micro}); pick a global batch that is a multiple of {workers * micro}"
        )


def dp_workers(cfg: Config, world_size: int) -> int:
    """Number of ranks that compute gradients on distinct data (parameter servers excluded)."""
    if cfg.parallel.pp * cfg.parallel.tp > 1 or cfg.parallel.dp > 1:
        return cfg.parallel.dp
    if cfg.dp.strategy == "ps":
        return world_size - cfg.dp.ps_servers
    return world_size


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `--config` reads back."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    top, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            tables.append(f"[{f.name}]")
            tables += [f"{g.name} = {fmt(getattr(v, g.name))}" for g in dataclasses.fields(v)]
            tables.append("")
        else:
            top.append(f"{f.name} = {fmt(v)}")
    return "\n".join(top + [""] + tables)
