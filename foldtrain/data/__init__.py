"""Data pipeline: raw text -> byte-level BPE tokens on disk -> deterministic batches.

Typical use::

    from foldtrain.data import resolve_data, TokenData, SequenceSampler, val_batches

    data = open_dataset(cfg.data)        # --data.mix, or --data.path prepared once, then reused
    sampler = SequenceSampler(data.split("train"), cfg.train.seq_len, cfg.train.seed)
    x, y = sampler.rank_batch(step, cfg.train.global_batch, rank, world)
"""

from foldtrain.data.dataset import TokenData
from foldtrain.data.mix import MixedData, open_dataset, open_mix, parse_mix
from foldtrain.data.prepare import FORMAT, is_prepared, prepare
from foldtrain.data.sampler import SequenceSampler, val_batches
from foldtrain.data.tokens import Blend, ShardedTokens
from foldtrain.data.resolve import cache_root, default_cache_dir, resolve_data
from foldtrain.data.sources import default_corpus_files, default_corpus_root, iter_default_corpus, iter_documents
from foldtrain.data.tokenizer import EOT, decode, encode_batch, eot_id, load_tokenizer, train_tokenizer, vocab_size

__all__ = [
    "EOT",
    "FORMAT",
    "Blend",
    "MixedData",
    "ShardedTokens",
    "open_dataset",
    "open_mix",
    "parse_mix",
    "SequenceSampler",
    "TokenData",
    "cache_root",
    "decode",
    "default_cache_dir",
    "default_corpus_files",
    "default_corpus_root",
    "encode_batch",
    "eot_id",
    "is_prepared",
    "iter_default_corpus",
    "iter_documents",
    "load_tokenizer",
    "prepare",
    "resolve_data",
    "train_tokenizer",
    "val_batches",
    "vocab_size",
]
