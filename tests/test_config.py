import pytest

from foldtrain.config import Config, build_config, load_toml, to_toml, validate
from foldtrain.config.validate import check_compression
from foldtrain.errors import ConfigError


def test_overrides_and_presets(tmp_path):
    cfg = build_config(
        [
            "--model.preset",
            "gpt2-small",
            "--train.steps",
            "50",
            "--resume",
            "--optim.lr=1e-4",
            "--parallel.layers_per_chunk",
            "3,3,3,3",
        ]
    )
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.vocab_size) == (12, 768, 50257)
    assert cfg.train.steps == 50 and cfg.resume is True and cfg.optim.lr == 1e-4
    assert cfg.parallel.layers_per_chunk == [3, 3, 3, 3]


def test_toml_then_cli_and_round_trip(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('precision = "bf16"\n[train]\nsteps = 7\nseq_len = 64\n[model]\nn_layer = 2\n')
    cfg = build_config(["--train.steps", "9"], str(f))
    assert (cfg.precision, cfg.train.steps, cfg.train.seq_len, cfg.model.n_layer) == ("bf16", 9, 64, 2)
    g = tmp_path / "round.toml"
    g.write_text(to_toml(cfg))
    again = Config()
    load_toml(again, g)
    assert again == cfg


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--train.setps", "5"], "did you mean --train.steps"),
        (["--trian.steps", "5"], "did you mean --train.steps"),
        (["--train.steps", "five"], "expected int"),
        (["--train.steps", "0"], "must be > 0"),
        (["--train.global_batch", "-4"], "must be > 0"),
        (["--optim.lr", "abc"], "expected float"),
        (["--train.seq_len", "512"], "larger than the model's context"),
        (["--model.preset", "gpt5"], "unknown model preset"),
        (["--precision", "fp8"], "choose one of"),
        (["--dp.strategy", "magic"], "choose one of"),
        (["--model.n_head", "5"], "not divisible"),
        (["--train.steps"], "needs a value"),
    ],
)
def test_bad_values_one_line(args, needle):
    with pytest.raises(ConfigError) as e:
        build_config(args)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_bad_toml(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config([], str(f))
    f.write_text("[train]\nstesp = 3\n")
    with pytest.raises(ConfigError, match="did you mean --train.steps"):
        build_config([], str(f))


def test_world_checks():
    cfg = build_config(["--train.global_batch", "6", "--dp.strategy", "ddp"])
    with pytest.raises(ConfigError, match="not divisible"):
        validate(cfg, world_size=4)
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match="ps_servers"):
        validate(build_config(["--dp.strategy", "ps", "--dp.ps_servers", "2"]), world_size=2)
    # the distributed optimizer belongs to the 3D engine; a --dp.strategy run is told which strategy shards
    with pytest.raises(ConfigError, match="--optim.distributed shards the 3D engine.*sharded-ps or fsdp"):
        validate(build_config(["--dp.strategy", "ddp", "--optim.distributed", "true"]), world_size=2)
    validate(build_config(["--parallel.dp", "2", "--optim.distributed", "true", "--train.global_batch", "4"]), 2)
    with pytest.raises(ConfigError, match="--optim.shard_tied slices .* add --optim.distributed true"):
        validate(build_config(["--parallel.dp", "2", "--optim.shard_tied", "true", "--train.global_batch", "4"]), 2)
    # --dp.compression casts the reductions of the allreduce, ddp and fsdp strategies and the 3D engine's only
    three_d = ["--parallel.dp", "2", "--train.global_batch", "4", "--dp.compression", "bf16"]
    validate(build_config(three_d), 2)
    validate(build_config(["--dp.strategy", "allreduce", "--dp.compression", "fp16", "--train.global_batch", "4"]), 2)
    with pytest.raises(ConfigError, match="--dp.compression bf16 applies to .* not to --dp.strategy sharded-ps"):
        validate(
            build_config(["--dp.strategy", "sharded-ps", "--dp.compression", "bf16", "--train.global_batch", "4"]), 2
        )
    with pytest.raises(ConfigError, match="--optim.distributed reduce-scatters .* drop one of the two"):
        validate(build_config([*three_d, "--optim.distributed", "true"]), 2)
    validate(build_config(["--dp.strategy", "fsdp", "--dp.compression", "bf16", "--train.global_batch", "4"]), 2)
    validate(build_config([*three_d, "--dp.strategy", "fsdp"]), 2)
    with pytest.raises(ConfigError, match="Horovod compresses to fp16 only"):
        check_compression(build_config(["--dp.strategy", "horovod", "--dp.compression", "bf16"]))
    check_compression(build_config(["--dp.strategy", "horovod", "--dp.compression", "fp16"]))
    # --dp.shard_vocab splits the rows as Shard(0) does, ceil-sized pieces first: 6 rows over 4 ranks are 2, 2, 2, 0
    tiny_vocab = ["--dp.strategy", "fsdp", "--train.global_batch", "4", "--model.vocab_size"]
    validate(build_config([*tiny_vocab, "7"]), world_size=4)
    with pytest.raises(ConfigError, match="6-row vocabulary over 4 ranks.*--dp.shard_vocab false"):
        validate(build_config([*tiny_vocab, "6"]), world_size=4)
    validate(build_config([*tiny_vocab, "6", "--dp.shard_vocab", "false"]), world_size=4)
