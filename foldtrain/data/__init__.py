"""Data pipeline: raw text -> byte-level BPE tokens in shards on disk -> deterministic batches.

Typical use::

    from foldtrain.data import open_dataset, SequenceSampler, val_batches

    data = open_dataset(cfg.data)        # --data.mix, or --data.path prepared once, then reused
    sampler = SequenceSampler(data.split("train"), cfg.train.seq_len, cfg.train.seed)
    x, y = sampler.rank_batch(step, cfg.train.global_batch, rank, world)

Names are imported lazily (PEP 562), so ``foldtrain prepare`` and its worker processes never
import torch (only the sampler needs it).
"""

from __future__ import annotations

import importlib
from typing import Any

# eager: torch-free, and ``prepare`` must be the function, not the submodule of the same name
# (re-exported: the ``as`` names say so)
from foldtrain.data.prepare import FORMAT as FORMAT
from foldtrain.data.prepare import is_prepared as is_prepared
from foldtrain.data.prepare import prepare as prepare

_EXPORTS = {
    "TokenData": "dataset",
    "MixedData": "mix",
    "open_dataset": "mix",
    "open_mix": "mix",
    "parse_mix": "mix",
    "cache_root": "resolve",
    "default_cache_dir": "resolve",
    "resolve_data": "resolve",
    "SequenceSampler": "sampler",
    "val_batches": "sampler",
    "default_corpus_files": "sources",
    "default_corpus_root": "sources",
    "iter_default_corpus": "sources",
    "iter_documents": "sources",
    "EOT": "tokenizer",
    "decode": "tokenizer",
    "encode_batch": "tokenizer",
    "eot_id": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
    "vocab_size": "tokenizer",
    "Blend": "tokens",
    "ShardedTokens": "tokens",
}

__all__ = sorted([*_EXPORTS, "FORMAT", "is_prepared", "prepare"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'foldtrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"foldtrain.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
