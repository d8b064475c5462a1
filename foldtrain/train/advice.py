"""Warnings for settings that run but are probably not what the user wants: one line each, with the fix.

Printed on the main rank before the first step (:func:`foldtrain.train.trainer._train`); nothing here
stops a run.
"""

from __future__ import annotations

from foldtrain.config import Config

# Peak learning rates that suit each preset: GPT-3's (Brown et al. 2020, Table 2.1) by model size,
# tiny's from the quickstart's tuning. The GPT-2 shapes take the GPT-3 model of about their size
# (small 125M, medium 350M, large 760M, XL 1.3B); bai2022 has gpt2-small's blocks.
REFERENCE_LR: dict[str, float] = {
    "tiny": 3e-3,
    "gpt2-small": 6e-4,
    "bai2022": 6e-4,
    "gpt2-medium": 3e-4,
    "gpt2-large": 2.5e-4,
    "gpt2-xl": 2e-4,
    "gpt3-1.3b": 2e-4,
    "gpt3-2.7b": 1.6e-4,
    "gpt3-6.7b": 1.2e-4,
    "gpt3-13b": 1e-4,
    "gpt3-175b": 0.6e-4,
}
LR_FACTOR = 3.0  # a rate more than this many times above or below the reference is pointed out
# the embedding is "far larger" than the tokenizer when more than this share of its rows is never used
UNUSED_VOCAB_SHARE = 0.25


def vocab_warning(cfg: Config, data_vocab: int) -> str | None:
    """The model's embedding has many more rows than the tokenizer has ids: parameters that never train."""
    model_vocab, d = cfg.model.vocab_size, cfg.model.d_model
    if model_vocab - data_vocab <= UNUSED_VOCAB_SHARE * model_vocab:
        return None
    unused = (model_vocab - data_vocab) * d
    fix = (
        f"prepare the data with --data.vocab_size {model_vocab} or the model's own tokenizer (--data.tokenizer)"
        if cfg.model.init_from
        else f"set --model.vocab_size {data_vocab} (or prepare the data with --data.vocab_size {model_vocab})"
    )
    return (
        f"the model's embedding has {model_vocab:,} rows but the tokenizer only {data_vocab:,} ids: "
        f"{unused:,} parameters ({model_vocab - data_vocab:,} x d_model {d}) are never used; {fix}"
    )


def lr_warning(cfg: Config) -> str | None:
    """The peak learning rate is far from what suits the preset (not checked for --model.init_from)."""
    ref = REFERENCE_LR.get(cfg.model.preset)
    lr = cfg.optim.lr
    if ref is None or cfg.model.init_from or ref / LR_FACTOR <= lr <= ref * LR_FACTOR:
        return None
    return (
        f"--optim.lr {lr:g} is {'above' if lr > ref else 'below'} what suits {cfg.model.preset} "
        f"(about {ref:g}, within x{LR_FACTOR:g}); consider --optim.lr {ref:g} --optim.min_lr {ref / 10:g}"
    )


def warnings_for(cfg: Config, data_vocab: int) -> list[str]:
    """Every warning that applies to this run, in the order they are printed."""
    return [w for w in (vocab_warning(cfg, data_vocab), lr_warning(cfg)) if w]
