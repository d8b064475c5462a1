"""Layout checks of the 3D engine: every bad layout fails with one clear line, before any process group."""

from __future__ import annotations

import pytest

from foldtrain.config import build_config
from foldtrain.errors import ConfigError
from foldtrain.schedules.layout import chunk_layers, resolve_microbatches, uses_3d_engine, validate_layout

MODEL = [
    "--model.n_layer",
    "8",
    "--model.n_head",
    "4",
    "--model.d_model",
    "32",
    "--model.context",
    "32",
    "--model.vocab_size",
    "64",
    "--train.seq_len",
    "16",
]


def cfg(*args: str):
    return build_config([*MODEL, "--train.global_batch", "16", *args])


def err(world: int, *args: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate_layout(cfg(*args), world)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_world_size_mismatch():
    msg = err(3, "--parallel.dp", "2", "--parallel.pp", "2")
    assert msg.startswith("--parallel.dp 2 x pp 2 x tp 1 = 4 but 3 processes were launched; launch 4 processes")
    assert "product is 3" in msg


def test_schedule_errors_surface():
    assert "needs --parallel.virtual >= 2" in err(2, "--parallel.pp", "2", "--parallel.schedule", "interleaved-1f1b")
    msg = err(
        4,
        "--parallel.pp",
        "4",
        "--parallel.virtual",
        "2",
        "--parallel.schedule",
        "interleaved-1f1b",
        "--parallel.microbatches",
        "2",
    )
    assert "multiple of --parallel.pp 4" in msg
    assert "runs one chunk per rank" in err(
        2, "--parallel.pp", "2", "--parallel.virtual", "2", "--parallel.schedule", "1f1b"
    )
    assert "only applies to --parallel.schedule fold" in err(
        2, "--parallel.pp", "2", "--fold.defer_reduce", "--parallel.schedule", "gpipe", "--optim.grad_clip", "0"
    )
    assert "needs --parallel.dp_sync per-chunk" in err(
        2, "--parallel.pp", "2", "--fold.defer_reduce", "--parallel.schedule", "fold", "--optim.grad_clip", "0"
    )


def test_defer_reduce_allows_clipping_but_not_fp16():
    base = [
        "--parallel.pp",
        "2",
        "--parallel.virtual",
        "2",
        "--parallel.schedule",
        "fold",
        "--parallel.dp_sync",
        "per-chunk",
        "--fold.defer_reduce",
    ]
    assert (
        validate_layout(cfg(*base), 2).segments == 4
    )  # grad_clip defaults to 1.0: the global norm waits for every chunk
    assert "--precision fp16" in err(2, *base, "--optim.grad_clip", "0", "--precision", "fp16")
    lay = validate_layout(cfg(*base, "--optim.grad_clip", "0"), 2)
    assert lay.segments == 4


def test_microbatch_errors():
    assert "x --parallel.dp 1 = 12, but --train.global_batch is 16" in err(
        2, "--parallel.pp", "2", "--parallel.microbatches", "3", "--train.micro_batch", "4"
    )
    assert "does not divide the 16 rows" in err(2, "--parallel.pp", "2", "--parallel.microbatches", "3")
    assert "--train.micro_batch 3 does not divide the 8 rows" in err(
        4, "--parallel.pp", "2", "--parallel.dp", "2", "--train.micro_batch", "3"
    )
    with pytest.raises(ConfigError, match="not divisible by --parallel.dp 3"):
        validate_layout(build_config([*MODEL, "--train.global_batch", "16", "--parallel.dp", "3"]), 3)


def test_microbatch_resolution():
    assert resolve_microbatches(cfg("--parallel.pp", "2")) == (16, 1)  # pipeline: micro-batches of one row
    assert resolve_microbatches(cfg("--parallel.tp", "2")) == (1, 16)  # no pipeline: one micro-batch
    assert resolve_microbatches(cfg("--parallel.pp", "2", "--parallel.dp", "2", "--parallel.microbatches", "4")) == (
        4,
        2,
    )
    assert resolve_microbatches(cfg("--parallel.pp", "2", "--parallel.dp", "2", "--train.micro_batch", "4")) == (2, 4)
    assert resolve_microbatches(
        cfg("--parallel.pp", "2", "--parallel.microbatches", "4", "--train.micro_batch", "4")
    ) == (4, 4)


def test_tensor_parallel_shape_errors():
    assert "--model.n_head 4 is not divisible by --parallel.tp 3" in err(
        3, "--parallel.tp", "3", "--model.d_model", "36"
    )


def test_a_vocabulary_not_divisible_by_tp_is_padded_not_refused():
    from foldtrain.config.validate import validate
    from foldtrain.model.gpt import GPTShape

    cfg = build_config(["--parallel.tp", "2", "--model.vocab_size", "63"])
    validate_layout(cfg, 2)
    assert GPTShape.from_config(cfg.model, 2).embedding_rows == 64
    cfg = build_config(["--parallel.tp", "4", "--model.vocab_size", "50257", "--model.vocab_multiple", "128"])
    assert GPTShape.from_config(cfg.model, 4).padded_vocab == 50304  # nanoGPT's and Megatron's size
    assert GPTShape.from_config(build_config(["--model.vocab_size", "64"]).model, 2).padded_vocab == 0
    with pytest.raises(ConfigError, match="--model.vocab_multiple must be > 0"):
        validate(build_config(["--model.vocab_multiple", "0"]))


def test_split_errors():
    fold = ["--parallel.schedule", "fold"]
    assert "leave a segment empty" in err(
        4, *fold, "--parallel.pp", "4", "--parallel.virtual", "3"
    )  # 12 segments, 8 layers
    assert "has 3 entries but the model is cut into 4 segments" in err(
        2, *fold, "--parallel.pp", "2", "--parallel.virtual", "2", "--parallel.layers_per_chunk", "2,3,3"
    )
    assert "sums to 7 but the model has 8 layers" in err(
        2, *fold, "--parallel.pp", "2", "--parallel.virtual", "2", "--parallel.layers_per_chunk", "2,2,2,1"
    )
    assert "gives segment 1 0 layers" in err(
        2, *fold, "--parallel.pp", "2", "--parallel.virtual", "2", "--parallel.layers_per_chunk", "4,0,2,2"
    )


def test_other_layout_errors():
    assert "--dp.strategy ddp cannot be combined" in err(2, "--parallel.pp", "2", "--dp.strategy", "ddp")
    defer = ("--parallel.pp", "2", "--parallel.virtual", "2", "--parallel.schedule", "fold", "--parallel.dp_sync")
    assert "--precision fp16-master: dynamic loss scaling" in err(
        2, *defer, "per-chunk", "--fold.defer_reduce", "true", "--precision", "fp16-master"
    )
    assert "needs a pipeline (--parallel.pp > 1)" in err(2, "--parallel.dp", "2", "--parallel.virtual", "2")


def test_chunk_layers():
    assert chunk_layers(7, 4) == [[0, 1], [2, 3], [4, 5], [6]]  # remainder to the earliest segments
    assert chunk_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunk_layers(7, 4, [1, 3, 2, 1]) == [[0], [1, 2, 3], [4, 5], [6]]
    assert chunk_layers(3, 1) == [[0, 1, 2]]
    with pytest.raises(ConfigError, match="segment empty"):
        chunk_layers(3, 4)


def test_valid_layouts_resolve():
    for prec in ("bf16-master", "fp16-master"):  # half-precision weights with fp32 masters run in the 3D engine
        validate_layout(cfg("--parallel.pp", "2", "--precision", prec), 2)
    lay = validate_layout(
        cfg("--parallel.dp", "2", "--parallel.pp", "2", "--parallel.tp", "2", "--parallel.schedule", "gpipe"), 8
    )
    assert (lay.dp, lay.pp, lay.tp, lay.virtual, lay.microbatches, lay.micro_batch, lay.world) == (2, 2, 2, 1, 8, 1, 8)
    assert lay.layers == ((0, 1, 2, 3), (4, 5, 6, 7))
    for sched, v in (("gpipe", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("fold", 4)):
        for sync in ("after-flush", "per-chunk"):
            validate_layout(
                cfg(
                    "--parallel.pp",
                    "2",
                    "--parallel.virtual",
                    str(v),
                    "--parallel.schedule",
                    sched,
                    "--parallel.dp_sync",
                    sync,
                ),
                2,
            )
    assert uses_3d_engine(cfg("--parallel.dp", "2")) and uses_3d_engine(cfg("--parallel.tp", "2"))
    assert not uses_3d_engine(cfg())


FSDP_PP = ("--dp.strategy", "fsdp", "--parallel.dp", "2", "--parallel.pp", "2")


def test_fsdp_runs_in_the_3d_engine():
    """--dp.strategy fsdp with a --parallel layout (pipeline, tensor parallelism, or both) runs in the 3D engine."""
    for sched in ("gpipe", "1f1b"):
        assert validate_layout(cfg(*FSDP_PP, "--parallel.schedule", sched), 4).dp == 2
    for sched in ("interleaved-1f1b", "fold"):
        validate_layout(cfg(*FSDP_PP, "--parallel.virtual", "2", "--parallel.schedule", sched), 4)
    lay = validate_layout(cfg(*FSDP_PP, "--parallel.tp", "2", "--precision", "bf16-master"), 8)
    assert (lay.dp, lay.pp, lay.tp) == (2, 2, 2)
    assert uses_3d_engine(cfg(*FSDP_PP))
    # no pipeline: data x tensor parallel (2D), or --parallel.dp alone
    assert validate_layout(cfg("--dp.strategy", "fsdp", "--parallel.dp", "2", "--parallel.tp", "2"), 4).pp == 1
    assert validate_layout(cfg("--dp.strategy", "fsdp", "--parallel.dp", "4"), 4).dp == 4


def test_fsdp_refusals():
    """Each combination fsdp does not run in the 3D engine is one line naming the problem and the fix, raised by
    the config checks every rank runs before any process group starts; the split-backward schedules run."""
    from foldtrain.config import validate

    fold = ("--parallel.virtual", "2", "--parallel.schedule", "fold", "--parallel.dp_sync", "per-chunk")
    assert "--fold.defer_reduce cannot be combined with --dp.strategy fsdp" in err(
        4, *FSDP_PP, *fold, "--fold.defer_reduce", "true"
    )
    assert "--optim.distributed cannot be combined with --dp.strategy fsdp" in err(
        4, *FSDP_PP, "--optim.distributed", "true"
    )
    for sched, v in (("zb-h1", "1"), ("zbv", "2"), ("interleaved-zb", "2"), ("fold-zb", "2")):  # the split backward
        assert validate_layout(cfg(*FSDP_PP, "--parallel.schedule", sched, "--parallel.virtual", v), 4).pp == 2
    assert "--dp.strategy sharded-ps cannot be combined" in err(4, *FSDP_PP[2:], "--dp.strategy", "sharded-ps")
    with pytest.raises(ConfigError, match="--optim.distributed cannot be combined with --dp.strategy fsdp"):
        validate(cfg(*FSDP_PP, "--optim.distributed", "true"), 4)
