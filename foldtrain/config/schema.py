"""The typed configuration tree: one dataclass per section, and the choices its fields take."""

from __future__ import annotations

from dataclasses import dataclass, field

from foldtrain.schedules.generators import SCHEDULE_NAMES

STRATEGIES = ("none", "ps", "sharded-ps", "allreduce", "ddp", "horovod", "fsdp", "dataparallel")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-master", "fp16-master")
SCHEDULES = SCHEDULE_NAMES
DP_SYNCS = ("after-flush", "per-chunk")
AC_MODES = ("none", "full")
COMPRESSIONS = ("none", "fp16", "bf16")
SHARD_COLLECTIVES = ("auto", "all_to_all", "reduce_scatter")
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
    # pad the embedding and output rows to a multiple of this (and of --parallel.tp); 1: only as tp needs
    vocab_multiple: int = 1
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
    # end this session after this step (with a checkpoint), e.g. for time-limited jobs; 0: run to steps
    stop_at: int = 0
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
    # CPU runs: keep freed memory in the process instead of faulting the largest tensors' pages in
    # again every step (glibc mallopt; foldtrain.hostmem.keep_freed_host_memory)
    malloc_cache: bool = True


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
    # the 3D engine: AdamW's moments and the fp32 masters sharded over --parallel.dp (ZeRO-1, Megatron's
    # distributed optimizer)
    distributed: bool = False
    # with --optim.distributed and a pipeline: the tied embedding's copies (first and last pipeline rank) have
    # their AdamW state sharded over dp too, at the price of an all-gather of the tied weight each step
    # (false: every dp rank has the whole copy in full after the tie's all-reduce, and steps half or all of it)
    shard_tied: bool = False
    # with --optim.distributed and a pipeline, without --optim.shard_tied: the two ends split the tied copy's state,
    # half each, and all-gather the stepped halves over their pair (where schedules.splits_tied_state allows it);
    # false: each end steps its whole copy, with no collective
    split_tied: bool = True


@dataclass
class CheckpointConfig:
    every: int = 100  # save every K steps (and always at the end); 0: only at the end
    keep: int = 3  # keep the last N checkpoints
    safetensors: bool = True  # also export the final weights as model.safetensors
    on_signal: bool = True  # on one of `signals`: finish the step, save a checkpoint on every rank, exit 75
    signals: str = "TERM,USR1"  # comma-separated signal names (with or without SIG)
    # abort (exit 76) if the save after a signal is not complete this long after it; 0: no limit
    signal_timeout_s: float = 90.0
    # --checkpoint.async (a Python keyword, hence the underscore): stage to host memory, write in the background
    async_: bool = False


@dataclass
class DPConfig:
    strategy: str = "none"
    ps_servers: int = 0  # dedicated parameter-server processes; 0: colocated on rank 0
    ps_staleness: int = 0  # >0: bounded-staleness asynchronous parameter server
    fusion_mb: float = 64.0  # allreduce tensor-fusion threshold
    first_bucket_mb: float = 1.0  # allreduce / sharded-ps: the first bucket closes here (the link starts early)
    # allreduce: a bucket also closes this long after the last launch (Horovod's cycle time); 0: off
    cycle_ms: float = 5.0
    compression: str = "none"  # allreduce wire compression: none, fp16, bf16
    bucket_mb: float = 25.0  # ddp bucket size
    shard_bucket_mb: float = 4.0  # sharded-ps: reduce-scatter / all-gather bucket size (transient memory, overlap)
    shard_slice_mb: float = 1.0  # sharded-ps: a bucket's reduce-scatter goes in slices of this size, two in flight
    # sharded-ps: gradients + slice buffers alive before the backward waits; 0: one bucket (the largest)
    shard_budget_mb: float = 0.0
    # sharded-ps' reduce-scatter: all_to_all + local sum (auto on gloo),
    # or the backend's reduce_scatter (auto elsewhere)
    shard_collective: str = "auto"
    timeout_s: float = 120.0  # a rank that stalls this long makes every rank fail
    # fsdp: free a block's gathered parameters after its forward and gather them again for its backward
    reshard_after_forward: bool = True
    # fsdp without a --parallel layout: the tied embedding and output layer split by vocabulary rows over the dp
    # ranks and never gathered (the activations travel instead); false: in the root's FSDP2 unit, as torchtitan
    shard_vocab: bool = True


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
