"""Warnings for settings that run but waste parameters or diverge: they fire, and not on the defaults."""

from foldtrain.config import build_config
from foldtrain.train.advice import REFERENCE_LR, lr_warning, vocab_warning, warnings_for
from tests.conftest import tiny_run_args


def test_defaults_with_tiny_warn_nothing():
    cfg = build_config([])
    assert cfg.model.preset == "tiny"
    assert warnings_for(cfg, cfg.data.vocab_size) == []


def test_gpt2_small_on_the_default_tokenizer_names_the_unused_parameters_and_the_fix():
    cfg = build_config(["--model.preset", "gpt2-small", "--optim.lr", "6e-4"])
    msg = vocab_warning(cfg, 8192)
    assert msg is not None
    assert f"{(50257 - 8192) * 768:,} parameters" in msg  # 32,305,920
    assert "--model.vocab_size 8192" in msg
    assert vocab_warning(cfg, 50257) is None  # GPT-2's own tokenizer: every row used


def test_vocab_warning_only_when_far_smaller():
    cfg = build_config(["--model.vocab_size", "9000"])
    assert vocab_warning(cfg, 8192) is None  # 9% unused: not far
    cfg = build_config(["--model.vocab_size", "16384"])
    assert "8,192 x d_model 96" in vocab_warning(cfg, 8192)


def test_lr_far_from_the_preset_names_the_suggested_rate():
    cfg = build_config(["--model.preset", "gpt2-small"])  # the default 3e-3 is tiny's rate
    msg = lr_warning(cfg)
    assert msg is not None and "above" in msg and "--optim.lr 0.0006" in msg
    cfg = build_config(["--optim.lr", "1e-4"])
    assert "below" in lr_warning(cfg) and "--optim.lr 0.003" in lr_warning(cfg)
    for lr in ("1.2e-3", "6e-3"):  # within x3 of tiny's 3e-3
        assert lr_warning(build_config(["--optim.lr", lr])) is None


def test_every_preset_has_a_reference_rate():
    from foldtrain.model.presets import PRESETS

    assert set(REFERENCE_LR) == set(PRESETS)


def test_the_trainer_prints_the_warnings(small_data, tmp_path, capsys):
    from foldtrain.train.trainer import train

    # small_data's tokenizer has 512 ids; an embedding of 2048 rows leaves 3/4 of them unused
    args = tiny_run_args(small_data, tmp_path / "run", "--train.steps", "1", "--optim.lr", "0.05")
    args[args.index("--model.vocab_size") + 1] = "2048"
    train(build_config(args))
    err = capsys.readouterr().err
    assert "warning: the model's embedding has 2,048 rows but the tokenizer only 512 ids" in err
    assert "warning: --optim.lr 0.05 is above what suits tiny" in err
    assert "warning: --optim.lr" in (tmp_path / "run" / "train.log").read_text()
