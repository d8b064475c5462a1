"""Preparing one shard: read its pieces, split each document by a seeded hash, encode, write.

Output of shard ``i`` in the staging directory::

    train-0000i.bin, val-0000i.bin              token ids (each document followed by <|endoftext|>)
    train-0000i_docs.npy, val-0000i_docs.npy    int64 start offset of each document in its .bin
    shard-0000i.json                            the shard's record: token counts, sha256, ...; written last,
                                                so a shard is complete exactly when its record exists

A document goes to ``val`` when ``blake2b(seed, its UTF-8 text) < cut`` (the hash read as a
64-bit integer; ``cut`` is ``val_fraction * 2**64``): the split depends on the document alone
(duplicates land on the same side), not on its position, the shard or the number of workers.
Memory is bounded by one encode batch (``CHUNK_CHARS`` characters) plus the write buffer.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from foldtrain.data import plan as plan_mod
from foldtrain.data.tokenizer import CHUNK_CHARS, iter_encoded, load_tokenizer

SPLITS = ("train", "val")
FLUSH_TOKENS = 1 << 20
_TOKENIZERS: dict[str, Any] = {}


@dataclass
class ShardJob:
    staging: str
    index: int
    plan_path: str
    offset: int
    count: int
    root: str
    text_field: str
    seed: int
    cut: int  # a document goes to val when its hash < cut
    dtype: str
    tokenizer: str  # path of tokenizer.json
    options_sha256: str


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def record_path(staging: Path, index: int) -> Path:
    return staging / f"shard-{index:05d}.json"


def doc_hash(seed: int, text: str) -> int:
    """The document's seeded 64-bit hash (its train/val side)."""
    key = seed.to_bytes(8, "little", signed=True)
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), key=key, digest_size=8).digest(), "little"
    )


def default_cut(val_fraction: float) -> int:
    return int(val_fraction * 2**64)


class SplitWriter:
    """Appends documents (ids + EOT) to ``<name>.bin.tmp``, hashing and recording offsets as it goes."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, eot: int) -> None:
        self.directory, self.name, self.dtype = directory, name, dtype
        self.eot = np.array([eot], dtype=dtype)
        self.fh: BinaryIO = (directory / f"{name}.bin.tmp").open("wb")
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.offsets: list[int] = []
        self._buf: list[np.ndarray] = []
        self._buffered = 0

    def add(self, ids: np.ndarray) -> None:
        self.offsets.append(self.tokens + self._buffered)
        self._buf += [ids.astype(self.dtype, copy=False), self.eot]
        self._buffered += len(ids) + 1
        if self._buffered >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            data = np.concatenate(self._buf).tobytes()
            self.fh.write(data)
            self.sha.update(data)
            self.tokens += self._buffered
            self._buf, self._buffered = [], 0

    def close(self) -> dict[str, Any]:
        """Flush, fsync and move the files into place; returns ``{tokens, sha256, documents}``."""
        self._flush()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        np.save(self.directory / f"{self.name}_docs.npy.tmp.npy", np.asarray(self.offsets, dtype=np.int64))
        os.replace(self.directory / f"{self.name}_docs.npy.tmp.npy", self.directory / f"{self.name}_docs.npy")
        os.replace(self.directory / f"{self.name}.bin.tmp", self.directory / f"{self.name}.bin")
        return {"tokens": self.tokens, "sha256": self.sha.hexdigest(), "documents": len(self.offsets)}

    def abort(self) -> None:
        self.fh.close()


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (tmp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _tokenizer(path: str) -> Any:
    tok = _TOKENIZERS.get(path)
    if tok is None:
        _TOKENIZERS.clear()
        tok = _TOKENIZERS[path] = load_tokenizer(path)
    return tok


def run_shard(job: ShardJob) -> dict[str, Any]:
    """Prepare shard ``job.index`` into ``job.staging``; returns its record (also written to disk)."""
    staging, dtype = Path(job.staging), np.dtype(job.dtype)
    tok = _tokenizer(job.tokenizer)
    eot = tok.token_to_id("<|endoftext|>")
    pieces = plan_mod.shard_pieces(Path(job.plan_path), job.offset, job.count)
    writers = [SplitWriter(staging, shard_name(s, job.index), dtype, eot) for s in SPLITS]
    dropped = [0, 0]
    min_train, max_val = 2**64, -1
    chars = 0
    batch: list[str] = []
    route: list[int] = []

    def flush() -> None:
        for side, ids in zip(route, iter_encoded(tok, batch, dtype=dtype, chunk_chars=1 << 62)):
            writers[side].add(ids)
        batch.clear()
        route.clear()

    try:
        for piece in pieces:
            for doc in plan_mod.iter_piece_docs(Path(job.root), piece, job.text_field, dropped):
                if not doc:
                    continue
                h = doc_hash(job.seed, doc)
                side = 1 if h < job.cut else 0
                if side:
                    max_val = max(max_val, h)
                else:
                    min_train = min(min_train, h)
                batch.append(doc)
                route.append(side)
                chars += len(doc)
                if chars >= CHUNK_CHARS:
                    flush()
                    chars = 0
        flush()
        infos = [w.close() for w in writers]
    except BaseException:
        for w in writers:
            w.abort()
        raise
    record = {
        "index": job.index,
        "options_sha256": job.options_sha256,
        "cut": job.cut,
        "train": infos[0],
        "val": infos[1],
        "min_train_hash": min_train if infos[0]["documents"] else None,
        "max_val_hash": max_val if infos[1]["documents"] else None,
        "dropped_files": dropped[0],
        "dropped_bytes": dropped[1],
        "input_bytes": sum(p[4] for p in pieces),
    }
    write_json(record_path(staging, job.index), record)
    return record


def run_shard_dict(job: dict[str, Any]) -> dict[str, Any]:
    """``run_shard`` for a pool (jobs travel as plain dicts)."""
    return run_shard(ShardJob(**job))


def job_dict(job: ShardJob) -> dict[str, Any]:
    return asdict(job)


def worker_init() -> None:
    """Pool workers encode on one thread each: the pool is the parallelism."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def check_shard_files(staging: Path, record: dict[str, Any], itemsize: int) -> str | None:
    """Why a shard recorded complete is not (a file missing or of the wrong size), else ``None``."""
    for split in SPLITS:
        name = shard_name(split, record["index"])
        f = staging / f"{name}.bin"
        if not f.is_file() or not (staging / f"{name}_docs.npy").is_file():
            return f"{f.name} or its _docs.npy is missing"
        if f.stat().st_size != record[split]["tokens"] * itemsize:
            return f"{f.name} has {f.stat().st_size} bytes, expected {record[split]['tokens'] * itemsize}"
    return None
