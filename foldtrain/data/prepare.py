"""``foldtrain prepare``: raw text in, a tokenized dataset directory out.

Output directory layout (format ``foldtrain-tokens-v1``)::

    train.bin, val.bin            token ids, raw little-endian uint16 (uint32 if vocab > 65535);
                                  every document is followed by <|endoftext|>
    train_docs.npy, val_docs.npy  int64 start offset of each document in its .bin
    tokenizer.json                the tokenizer that produced the ids
    meta.json                     format, dtype, vocab_size, eot_id, per-split token counts
                                  and sha256, n_documents, source, tokenizer, seed, ...

The split is by document: the document order is shuffled with ``seed`` and
the first ``ceil(val_fraction * n)`` documents (at least one) go to ``val``.
A single-document corpus is split at the tail of its tokens instead.

Writing is atomic: everything is built in a hidden sibling directory and
renamed into place only when complete, so a failure never leaves a
half-written dataset and never destroys a dataset already at ``out_dir``.
The corpus is held in memory while preparing (fine for hundreds of MB).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from foldtrain.data import sources
from foldtrain.data.tokenizer import eot_id, iter_encoded, load_tokenizer, train_tokenizer, vocab_size as tok_vocab_size
from foldtrain.errors import DataError

FORMAT = "foldtrain-tokens-v1"
SPLITS = ("train", "val")
_FLUSH_TOKENS = 1 << 20


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def token_dtype(vocab: int) -> np.dtype:
    """Little-endian uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab <= 65535 else np.dtype("<u4")


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` looks like a prepared dataset (it has ``meta.json`` and ``train.bin``).

    Only the layout is checked; ``TokenData.open`` validates the contents.
    """
    p = Path(path)
    return (p / "meta.json").is_file() and (p / "train.bin").is_file()


class _SplitWriter:
    """Appends documents (ids + EOT) to ``<name>.bin``, hashing and recording offsets as it goes."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, eot: int) -> None:
        self.directory, self.name, self.dtype = directory, name, dtype
        self.eot = np.array([eot], dtype=dtype)
        self.fh: BinaryIO = (directory / f"{name}.bin").open("wb")
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.offsets: list[int] = []
        self._buf: list[np.ndarray] = []
        self._buffered = 0

    def add(self, ids: np.ndarray) -> None:
        self.offsets.append(self.tokens + self._buffered)
        self._buf += [ids.astype(self.dtype, copy=False), self.eot]
        self._buffered += len(ids) + 1
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            data = np.concatenate(self._buf).tobytes()
            self.fh.write(data)
            self.sha.update(data)
            self.tokens += self._buffered
            self._buf, self._buffered = [], 0

    def close(self) -> dict[str, Any]:
        self._flush()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        np.save(self.directory / f"{self.name}_docs.npy", np.asarray(self.offsets, dtype=np.int64))
        return {"tokens": self.tokens, "sha256": self.sha.hexdigest(), "documents": len(self.offsets)}


def _check_source(source: str | Path | None) -> str:
    """A printable, absolute name of the source; rejects inputs that are already prepared."""
    if source is None or str(source) == "":
        return f"stdlib:{sources.default_corpus_root()}"
    p = Path(source).expanduser()
    if p.is_dir() and is_prepared(p):
        raise DataError(f"{p} is already a prepared dataset; pass it to --data.path to train on it instead of preparing it")
    return str(p.resolve())


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"output path {out} is a file; pass a directory to --data.out")
    if out.is_dir() and not is_prepared(out) and any(out.iterdir()):
        raise DataError(f"output directory {out} is not empty and holds no prepared dataset; choose a new or empty --data.out")


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing dataset there is removed only afterwards."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_documents(tmp: Path, tok: Any, docs: list[str], order: Iterable[int], name: str, dtype: np.dtype, eot: int) -> dict[str, Any]:
    w = _SplitWriter(tmp, name, dtype, eot)
    try:
        for ids in iter_encoded(tok, (docs[i] for i in order), dtype=dtype):
            w.add(ids)
    except BaseException:
        w.fh.close()
        raise
    return w.close()


def _write_single(tmp: Path, tok: Any, doc: str, val_fraction: float, dtype: np.dtype, eot: int) -> dict[str, dict[str, Any]]:
    """One document: its last ``ceil(val_fraction * n)`` tokens (at least one) become ``val``."""
    (ids,) = list(iter_encoded(tok, [doc], dtype=dtype))
    k = min(max(1, math.ceil(val_fraction * len(ids))), len(ids) - 1) if len(ids) >= 2 else 0
    out = {}
    for name, part in (("train", ids[: len(ids) - k]), ("val", ids[len(ids) - k :])):
        w = _SplitWriter(tmp, name, dtype, eot)
        w.add(part)
        out[name] = w.close()
    return out


def prepare(
    source: str | Path | None,
    out_dir: str | Path,
    vocab_size: int = 8192,
    tokenizer_path: str | Path = "",
    text_field: str = "text",
    val_fraction: float = 0.005,
    seed: int = 1337,
    quiet: bool = False,
) -> dict[str, Any]:
    """Tokenize ``source`` (``None``/``""``: the default corpus) into ``out_dir``; returns the meta.

    Trains a byte-level BPE of ``vocab_size`` on the corpus unless
    ``tokenizer_path`` names an existing ``tokenizer.json``.
    """
    say = (lambda _msg: None) if quiet else log
    t0 = time.perf_counter()
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--data.val_fraction must be in (0, 1), got {val_fraction}; pass e.g. 0.005")
    out = Path(out_dir).expanduser().absolute()
    _check_out_dir(out)
    label = _check_source(source)
    fingerprint = sources.fingerprint(source)

    docs = [d for d in sources.iter_documents(source, text_field) if d]
    n_chars = sum(map(len, docs))
    if not docs:
        raise DataError(f"{label} yielded no tokens (no non-empty documents); point --data.path at text files")
    t_read = time.perf_counter()
    say(f"read {len(docs):,} documents ({n_chars / 1e6:.1f}M characters) from {label} in {t_read - t0:.1f}s")

    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
        say(f"loaded tokenizer {tokenizer_path} (vocab {tok_vocab_size(tok):,})")
    else:
        tok = train_tokenizer(docs, vocab_size)
        say(f"trained byte-level BPE tokenizer (vocab {tok_vocab_size(tok):,}) in {time.perf_counter() - t_read:.1f}s")
    t_tok = time.perf_counter()
    vocab, eot = tok_vocab_size(tok), eot_id(tok)
    dtype = token_dtype(vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        if len(docs) >= 2:
            order = np.random.default_rng(seed).permutation(len(docs))
            n_val = min(len(docs) - 1, max(1, math.ceil(val_fraction * len(docs))))
            splits = {
                "val": _write_documents(tmp, tok, docs, order[:n_val].tolist(), "val", dtype, eot),
                "train": _write_documents(tmp, tok, docs, order[n_val:].tolist(), "train", dtype, eot),
            }
        else:
            splits = _write_single(tmp, tok, docs[0], val_fraction, dtype, eot)
        tok.save(str(tmp / "tokenizer.json"))
        meta: dict[str, Any] = {
            "format": FORMAT,
            "dtype": dtype.name,
            "vocab_size": vocab,
            "eot_id": eot,
            "splits": {name: splits[name] for name in SPLITS},
            "n_documents": len(docs),
            "source": label,
            "tokenizer": "tokenizer.json",
            "seed": seed,
            "val_fraction": val_fraction,
            "text_field": text_field,
            "requested_vocab_size": vocab_size,
            "tokenizer_source": str(Path(tokenizer_path).expanduser().absolute()) if tokenizer_path else "",
            "source_fingerprint": fingerprint,
        }
        with (tmp / "meta.json").open("w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_train, n_val_tok = meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]
    say(
        f"wrote {n_train:,} train + {n_val_tok:,} val tokens ({dtype.name}) to {out} in {time.perf_counter() - t_tok:.1f}s; "
        f"total {time.perf_counter() - t0:.1f}s"
    )
    return meta
