"""Reading a prepared dataset: validation and memory-mapped splits.

Two formats load: ``foldtrain-tokens-v1`` (one ``train.bin``/``val.bin``) and
``foldtrain-tokens-v2`` (shards ``train-00000.bin`` ... read as one array, ``ShardedTokens``).
``TokenData.open`` checks ``meta.json`` and every token file's size against the recorded
token count (always: a missing or truncated shard is an error), and their sha256: hashing
runs at about 0.7 GB/s, so by default (``verify=None``) checksums are verified whenever the
dataset totals at most ``VERIFY_AUTO_BYTES`` (1 GiB); larger datasets get the size checks
only unless ``verify=True`` (``--data.verify``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from foldtrain.data.sources import one_line
from foldtrain.data.tokens import ShardedTokens
from foldtrain.errors import DataError

FORMAT_V1 = "foldtrain-tokens-v1"
FORMAT = "foldtrain-tokens-v2"
FORMATS = (FORMAT_V1, FORMAT)
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
VERIFY_AUTO_BYTES = 1 << 30
_FIX = "re-run foldtrain prepare"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def _read_meta(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise DataError(
            f"prepared data directory {root} does not exist; "
            "run `foldtrain prepare` or pass a prepared directory to --data.path"
        )
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise DataError(
            f"{root} has no meta.json, so it is not a prepared dataset; run `foldtrain prepare` to create one"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is unreadable ({one_line(e)}); {_FIX}") from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{meta_path} has format {found!r}, expected {FORMAT!r} or {FORMAT_V1!r}; {_FIX}")
    try:
        if meta["dtype"] not in DTYPES:
            raise DataError(f"{meta_path} has unknown dtype {meta['dtype']!r}; {_FIX}")
        for key in ("vocab_size", "eot_id"):
            if not isinstance(meta[key], int) or meta[key] < 0:
                raise DataError(f"{meta_path} has an invalid {key} {meta[key]!r}; {_FIX}")
        entries = [meta["splits"]] if meta["format"] == FORMAT_V1 else meta["shards"]
        if not isinstance(entries, list) or not entries:
            raise DataError(f"{meta_path} lists no shards; {_FIX}")
        for entry in entries:
            for name in ("train", "val"):
                s = entry[name]
                if not isinstance(s["tokens"], int) or s["tokens"] < 0 or not isinstance(s["sha256"], str):
                    raise DataError(f"{meta_path} has an invalid entry for split {name}; {_FIX}")
        if not isinstance(meta["tokenizer"], str):
            raise DataError(f"{meta_path} has an invalid tokenizer entry; {_FIX}")
    except (KeyError, TypeError) as e:
        raise DataError(f"{meta_path} lacks or garbles an entry ({type(e).__name__}: {one_line(e)}); {_FIX}") from None
    return meta


def _token_files(root: Path, meta: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """Every token file of the dataset with its meta entry (``tokens``, ``sha256``)."""
    if meta["format"] == FORMAT_V1:
        return [(root / f"{name}.bin", meta["splits"][name]) for name in ("train", "val")]
    return [(root / f"{name}-{i:05d}.bin", s[name]) for name in ("train", "val") for i, s in enumerate(meta["shards"])]


def _map(f: Path, dtype: np.dtype, n: int) -> np.ndarray:
    return np.memmap(f, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype=dtype)


def fingerprint(meta: dict[str, Any]) -> str:
    """A short identity of prepared token data from its ``meta.json``: vocabulary, dtype, and every
    split's (or shard's) token count and checksum — what the tokens are, not where they live."""
    parts = meta.get("shards") or [meta["splits"]]
    key = [
        meta.get("dtype"),
        meta.get("vocab_size"),
        meta.get("eot_id"),
        [[part[s].get("tokens"), part[s].get("sha256")] for part in parts for s in ("train", "val")],
    ]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]


@dataclass
class TokenData:
    """A prepared dataset directory, validated, with its splits memory-mapped read-only."""

    path: Path
    meta: dict[str, Any]
    splits: dict[str, np.ndarray] = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.meta)

    @classmethod
    def open(cls, path: str | Path, verify: bool | None = None) -> TokenData:
        """Validate and memory-map ``path``; ``verify``: check sha256 (``None``: when <= 1 GiB)."""
        root = Path(path).expanduser()
        meta = _read_meta(root)
        dtype = DTYPES[meta["dtype"]]
        files = _token_files(root, meta)
        for f, info in files:
            expected = info["tokens"] * dtype.itemsize
            if not f.is_file():
                raise DataError(f"token file {f} is missing; {_FIX}")
            size = f.stat().st_size
            if size < expected:
                raise DataError(f"token file {f} is truncated ({size} bytes, expected {expected}); {_FIX}")
            if size != expected:
                raise DataError(f"token file {f} has {size} bytes, expected {expected}; {_FIX}")
        if verify is None:
            verify = sum(f.stat().st_size for f, _ in files) <= VERIFY_AUTO_BYTES
        if verify:
            for f, info in files:
                if _sha256_file(f) != info["sha256"]:
                    raise DataError(f"token file {f} is corrupt (sha256 does not match meta.json); {_FIX}")
        tok = root / meta["tokenizer"]
        if not tok.is_file():
            raise DataError(f"tokenizer file {tok} is missing; {_FIX}")
        splits: dict[str, np.ndarray | ShardedTokens] = {}
        for name in ("train", "val"):
            parts = [_map(f, dtype, info["tokens"]) for f, info in files if f.name.startswith(name)]
            splits[name] = parts[0] if len(parts) == 1 else ShardedTokens(parts)
        return cls(root, meta, splits)  # type: ignore[arg-type]

    @property
    def sharded(self) -> bool:
        return self.meta["format"] != FORMAT_V1

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.meta["eot_id"])

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.meta["tokenizer"]

    def split(self, name: str) -> np.ndarray:
        """The token ids of split ``train`` or ``val`` (a read-only memory map, or ``ShardedTokens``)."""
        if name not in self.splits:
            raise KeyError(f"unknown split {name!r}; choose one of {sorted(self.splits)}")
        return self.splits[name]

    def doc_offsets(self, name: str) -> np.ndarray:
        """Start offset of every document of split ``name`` in its token array (all shards)."""
        names = (
            [f"{name}_docs.npy"]
            if not self.sharded
            else [f"{name}-{i:05d}_docs.npy" for i in range(len(self.meta["shards"]))]
        )
        out, base = [], 0
        for fname, n in zip(
            names,
            (
                [self.meta["splits"][name]["tokens"]]
                if not self.sharded
                else [s[name]["tokens"] for s in self.meta["shards"]]
            ),
        ):
            f = self.path / fname
            if not f.is_file():
                raise DataError(f"document index {f} is missing; {_FIX}")
            out.append(np.load(f, allow_pickle=False) + base)
            base += n
        return np.concatenate(out)

    def load_tokenizer(self) -> Any:
        """The dataset's tokenizer (a ``tokenizers.Tokenizer``)."""
        from foldtrain.data.tokenizer import load_tokenizer  # noqa: PLC0415 (keeps `tokenizers` off the training import path)

        return load_tokenizer(self.tokenizer_path)
