"""The work plan of a prepare: the input cut into *pieces*, the pieces grouped into *shards*.

A piece is a unit of input read by one worker, as a tuple ``(kind, rel, start, end, size)``:

- ``("text", rel, 0, 0, size)``: a whole file, one document (binary files are skipped);
- ``("stdlib", rel, 0, 0, size)``: a default-corpus file (generated tables left out);
- ``("jsonl", rel, start, end, size)``: the lines of a JSONL file that begin in bytes ``[start, end)``;
- ``("hf", "", start, end, size)``: rows ``[start, end)`` of a Hugging Face dataset on disk.

``rel`` is relative to the source's root, so the plan (and its sha256) is the same on every
machine that sees the corpus, wherever it is mounted. Pieces are taken in the source's
deterministic order and cut into shards of about ``shard_mb`` of input each; output shard ``i``
holds the documents of input shard ``i`` in order, so the dataset does not depend on how many
workers or machines prepared it. The plan is streamed to ``plan.jsonl`` (one piece a line);
only one ``(offset, pieces, bytes)`` row per shard stays in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from foldtrain.data import sources
from foldtrain.errors import DataError

PIECE_BYTES = 1 << 22  # JSONL files and HF datasets are cut into pieces of about this many bytes
Piece = tuple[str, str, int, int, int]


@dataclass
class Plan:
    root: str  # absolute source root ("" never: the default corpus has the stdlib's root)
    path: Path  # plan.jsonl
    shards: list[tuple[int, int, int]]  # per shard: (byte offset in plan.jsonl, pieces, input bytes)
    sha256: str
    input_bytes: int


def source_root(source: str | Path | None) -> tuple[Path, str]:
    """``(root, kind)`` of a source: kind is ``stdlib``, ``dir``, ``hf``, ``jsonl`` or ``text``."""
    if source is None or str(source) == "":
        return sources.default_corpus_root(), "stdlib"
    p = Path(source).expanduser().absolute()
    if not p.exists():
        raise DataError(f"data path {p} does not exist; pass an existing file or directory to --data.path")
    if p.is_dir():
        return p, "hf" if sources.is_hf_dataset(p) else "dir"
    if not p.is_file():
        raise DataError(
            f"data path {p} is not a regular file or directory; "
            "pass a text file, directory or .jsonl file to --data.path"
        )
    return p, "jsonl" if p.suffix == ".jsonl" else "text"


def _byte_ranges(kind: str, rel: str, size: int) -> Iterator[Piece]:
    for a in range(0, max(size, 1), PIECE_BYTES):
        b = min(size, a + PIECE_BYTES)
        yield (kind, rel, a, b, b - a)


def iter_pieces(source: str | Path | None, text_field: str) -> Iterator[Piece]:
    """The pieces of ``source`` in order (see the module docstring)."""
    root, kind = source_root(source)
    if kind == "stdlib":
        for f in sources.default_corpus_files():
            yield ("stdlib", str(f.relative_to(root)), 0, 0, f.stat().st_size)
    elif kind == "dir":
        any_file = False
        for f in sources.iter_files(root):
            any_file = True
            size = f.stat().st_size
            rel = str(f.relative_to(root))
            if f.suffix == ".jsonl":
                yield from _byte_ranges("jsonl", rel, size)
            else:
                yield ("text", rel, 0, 0, size)
        if not any_file:
            raise DataError(
                f"directory {root} is empty (no non-hidden files); put text files in it or pass another --data.path"
            )
    elif kind == "hf":
        ds = sources.load_hf_dataset(root, text_field)
        n = len(ds)
        size = sum(f.stat().st_size for f in root.rglob("*.arrow")) or n
        rows = max(1, int(PIECE_BYTES * n / max(size, 1)))
        for a in range(0, n, rows):
            b = min(n, a + rows)
            yield ("hf", "", a, b, max(1, size * (b - a) // n))
    elif kind == "jsonl":
        yield from _byte_ranges("jsonl", root.name, root.stat().st_size)
    else:
        with root.open("rb") as fh:
            if sources.is_binary(fh.read(sources.BINARY_PROBE_BYTES)):
                raise DataError(
                    f"{root} looks binary (it contains NUL bytes); "
                    "pass a text file, directory or .jsonl file to --data.path"
                )
        yield ("text", root.name, 0, 0, root.stat().st_size)


def make_plan(source: str | Path | None, text_field: str, shard_bytes: int, out: Path) -> Plan:
    """Write ``out`` (plan.jsonl) and return the shard table; one pass over the source's listing."""
    root, kind = source_root(source)
    base = root if kind in ("stdlib", "dir", "hf") else root.parent
    h = hashlib.sha256()
    shards: list[tuple[int, int, int]] = []
    offset = count = size = total = 0
    start = 0
    with out.open("wb") as fh:
        for piece in iter_pieces(source, text_field):
            line = (json.dumps(piece, ensure_ascii=False) + "\n").encode("utf-8", "surrogateescape")
            fh.write(line)
            h.update(line)
            if count == 0:
                start = offset
            offset += len(line)
            count += 1
            size += piece[4]
            total += piece[4]
            if size >= shard_bytes:
                shards.append((start, count, size))
                count = size = 0
        if count:
            shards.append((start, count, size))
    return Plan(str(base), out, shards, h.hexdigest(), total)


def shard_pieces(plan_path: Path, offset: int, count: int) -> list[Piece]:
    """The pieces of one shard, read from plan.jsonl."""
    out = []
    with plan_path.open("rb") as fh:
        fh.seek(offset)
        for _ in range(count):
            out.append(tuple(json.loads(fh.readline().decode("utf-8", "surrogateescape"))))
    return out  # type: ignore[return-value]


def iter_piece_docs(root: Path, piece: Piece, text_field: str, dropped: list[int] | None = None) -> Iterator[str]:
    """The documents of one piece; ``dropped`` (``[files, bytes]``) counts default-corpus files left out."""
    kind, rel, start, end, size = piece
    path = root / rel if rel else root
    if kind == "text":
        data = sources._read_quietly(path)
        if data is not None and not sources.is_binary(data):
            yield sources.decode_bytes(data)
    elif kind == "stdlib":
        text = sources.read_default_file(path)
        if text is None:
            if dropped is not None:
                dropped[0] += 1
                dropped[1] += size
        else:
            yield text
    elif kind == "jsonl":
        yield from sources.iter_jsonl(path, text_field, start, end)
    elif kind == "hf":
        yield from sources.iter_hf_dataset(path, text_field, start, end)
    else:
        raise DataError(
            f"unknown piece kind {kind!r} in the prepare plan; delete the .partial directory and prepare again"
        )


def piece_hash(seed: int, piece: Piece) -> float:
    """A seeded number in [0, 1) per piece (which pieces the tokenizer is trained on)."""
    digest = hashlib.blake2b(json.dumps([seed, *piece[:4]]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def tokenizer_sample(plan: Plan, text_field: str, sample_bytes: int, seed: int) -> Iterator[str]:
    """Documents of a seeded sample of about ``sample_bytes`` of input, chosen piece by piece."""
    frac = min(1.0, sample_bytes / max(1, plan.input_bytes))
    taken = 0
    root = Path(plan.root)
    with plan.path.open("rb") as fh:
        for raw in fh:
            piece: Piece = tuple(json.loads(raw.decode("utf-8", "surrogateescape")))  # type: ignore[assignment]
            if frac < 1.0 and piece_hash(seed, piece) >= frac:
                continue
            for doc in iter_piece_docs(root, piece, text_field):
                if doc:
                    yield doc
                    taken += len(doc)
            if taken >= sample_bytes:
                return
