"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``): train, load, encode, decode.

The tokenizer is GPT-2 style: a byte-level pre-tokenizer (every string, any
unicode, round-trips exactly), BPE merges learned from the corpus, and one
special token ``<|endoftext|>`` that separates documents. A literal
``<|endoftext|>`` inside a document is encoded as ordinary text, so documents
can never inject separators and ``decode(encode(text)) == text`` always holds.

Encoding always goes through the library's parallel (Rust) batch encoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from foldtrain.data.sources import one_line
from foldtrain.errors import DataError

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte symbols + <|endoftext|>
PIECE_CHARS = 1 << 16  # long documents are encoded as pieces of about this many characters
CHUNK_CHARS = 1 << 22  # characters handed to one batch-encode call


def train_tokenizer(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learn a byte-level BPE of (at most) ``vocab_size`` tokens, ``<|endoftext|>`` included.

    Deterministic: the same documents in the same order give the same tokenizer.
    The result may be smaller than ``vocab_size`` when the corpus has too few
    distinct pairs; ``tok.get_vocab_size()`` is the real size.
    """
    if vocab_size < MIN_VOCAB:
        raise DataError(f"--data.vocab_size {vocab_size} is too small for a byte-level BPE; use at least {MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    length = len(docs) if isinstance(docs, Sequence) else None
    tok.train_from_iterator(docs, trainer, length=length)
    _configure(tok)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json``; ``<|endoftext|>`` is added as a special token if it lacks one."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"tokenizer file {p} does not exist; pass an existing tokenizer.json to --data.tokenizer")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 (the Rust loader raises a bare Exception)
        raise DataError(
            f"{p} is not a valid tokenizer.json ({one_line(e)}); pass a file saved by tokenizers' Tokenizer.save"
        ) from None
    _configure(tok)
    return tok


def _configure(tok: Tokenizer) -> None:
    if tok.token_to_id(EOT) is None:
        tok.add_special_tokens([EOT])
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in text is text, not a separator


def eot_id(tok: Tokenizer) -> int:
    """Id of the document separator ``<|endoftext|>``."""
    i = tok.token_to_id(EOT)
    if i is None:
        raise DataError(f"the tokenizer has no {EOT} token; load it with load_tokenizer or re-run foldtrain prepare")
    return i


def vocab_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer can produce (added tokens included)."""
    return tok.get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------- encoding


def _cut(text: str, start: int, limit: int) -> int:
    """A split point in (start, limit]: before a newline that follows a non-space character.

    The byte-level pre-tokenizer (GPT-2 regex) never joins such a newline with
    what precedes it, so encoding the two sides separately gives exactly the
    same ids as encoding the whole. Falls back to a hard cut (still lossless).
    """
    i = text.rfind("\n", start + 1, limit)
    tries = 0
    while i > start and tries < 256:
        if not text[i - 1].isspace():
            return i
        i = text.rfind("\n", start + 1, i)
        tries += 1
    return limit


def _pieces(text: str) -> list[str]:
    if len(text) <= PIECE_CHARS:
        return [text]
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = _cut(text, start, start + PIECE_CHARS)
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _batch_encode(tok: Tokenizer, texts: list[str]) -> list[Any]:
    fast = getattr(tok, "encode_batch_fast", None)  # no offsets: less memory, faster
    if fast is not None:
        return fast(texts, add_special_tokens=False)
    return tok.encode_batch(texts, add_special_tokens=False)


def iter_encoded(
    tok: Tokenizer, docs: Iterable[str], dtype: Any = np.int64, chunk_chars: int = CHUNK_CHARS
) -> Iterator[np.ndarray]:
    """One array of token ids per document, in order, encoded in parallel batches.

    Documents are gathered into chunks of about ``chunk_chars`` characters (long
    documents split into pieces) and each chunk is one call to the library's
    batch encoder, so memory stays bounded and all cores are used.
    """
    texts: list[str] = []
    owners: list[int] = []  # per piece: index of its document within the chunk
    n_docs = 0
    size = 0

    def flush() -> Iterator[np.ndarray]:
        encs = _batch_encode(tok, texts)
        parts: list[list[np.ndarray]] = [[] for _ in range(n_docs)]
        for owner, enc in zip(owners, encs):
            parts[owner].append(np.asarray(enc.ids, dtype=dtype))
        for p in parts:
            yield p[0] if len(p) == 1 else (np.concatenate(p) if p else np.zeros(0, dtype=dtype))

    for doc in docs:
        pieces = _pieces(doc) if doc else []
        texts.extend(pieces)
        owners.extend([n_docs] * len(pieces))
        n_docs += 1
        size += len(doc)
        if size >= chunk_chars:
            yield from flush()
            texts, owners, n_docs, size = [], [], 0, 0
    if n_docs:
        yield from flush()


def encode_batch(tok: Tokenizer, docs: Iterable[str], chunk_chars: int = CHUNK_CHARS) -> list[list[int]]:
    """Token ids of each document (no separators added), via the parallel batch encoder."""
    return [a.tolist() for a in iter_encoded(tok, docs, chunk_chars=chunk_chars)]


def decode(tok: Tokenizer, ids: Any) -> str:
    """Text of a sequence of ids (a list, numpy array or tensor); special tokens are kept."""
    seq = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return tok.decode(seq, skip_special_tokens=False)
