"""Reading a prepared dataset: validation, memory-mapped splits, and batch sampling.

``TokenData.open`` checks ``meta.json``, the token files' sizes against the
recorded token counts, and their sha256. Hashing runs at about 0.7 GB/s
(the 17 MB default corpus takes ~25 ms), so by default (``verify=None``) the
checksum is verified whenever the splits total at most ``VERIFY_AUTO_BYTES``
(1 GiB); larger datasets get the size check only unless ``verify=True``.

``SequenceSampler`` is stateless: a batch is a pure function of
``(seed, step)``, so resuming at a step reproduces the stream exactly, and
data-parallel ranks each build only their own rows of the global batch.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from foldtrain.data.sources import one_line
from foldtrain.errors import DataError

FORMAT = "foldtrain-tokens-v1"
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
        raise DataError(f"prepared data directory {root} does not exist; run `foldtrain prepare` or pass a prepared directory to --data.path")
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{root} has no meta.json, so it is not a prepared dataset; run `foldtrain prepare` to create one")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is unreadable ({one_line(e)}); {_FIX}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{meta_path} has format {found!r}, expected {FORMAT!r}; {_FIX}")
    try:
        if meta["dtype"] not in DTYPES:
            raise DataError(f"{meta_path} has unknown dtype {meta['dtype']!r}; {_FIX}")
        for key in ("vocab_size", "eot_id"):
            if not isinstance(meta[key], int) or meta[key] < 0:
                raise DataError(f"{meta_path} has an invalid {key} {meta[key]!r}; {_FIX}")
        for name in ("train", "val"):
            s = meta["splits"][name]
            if not isinstance(s["tokens"], int) or s["tokens"] < 0 or not isinstance(s["sha256"], str):
                raise DataError(f"{meta_path} has an invalid entry for split {name}; {_FIX}")
        if not isinstance(meta["tokenizer"], str):
            raise DataError(f"{meta_path} has an invalid tokenizer entry; {_FIX}")
    except (KeyError, TypeError) as e:
        raise DataError(f"{meta_path} lacks or garbles an entry ({type(e).__name__}: {one_line(e)}); {_FIX}") from None
    return meta


@dataclass
class TokenData:
    """A prepared dataset directory, validated, with its splits memory-mapped read-only."""

    path: Path
    meta: dict[str, Any]
    splits: dict[str, np.ndarray] = field(repr=False)

    @classmethod
    def open(cls, path: str | Path, verify: bool | None = None) -> TokenData:
        """Validate and memory-map ``path``; ``verify``: check sha256 (``None``: when <= 1 GiB)."""
        root = Path(path).expanduser()
        meta = _read_meta(root)
        dtype = DTYPES[meta["dtype"]]
        files = {name: root / f"{name}.bin" for name in ("train", "val")}
        for name, f in files.items():
            expected = meta["splits"][name]["tokens"] * dtype.itemsize
            if not f.is_file():
                raise DataError(f"token file {f} is missing; {_FIX}")
            size = f.stat().st_size
            if size < expected:
                raise DataError(f"token file {f} is truncated ({size} bytes, expected {expected}); {_FIX}")
            if size != expected:
                raise DataError(f"token file {f} has {size} bytes, expected {expected}; {_FIX}")
        if verify is None:
            verify = sum(f.stat().st_size for f in files.values()) <= VERIFY_AUTO_BYTES
        if verify:
            for name, f in files.items():
                if _sha256_file(f) != meta["splits"][name]["sha256"]:
                    raise DataError(f"token file {f} is corrupt (sha256 does not match meta.json); {_FIX}")
        tok = root / meta["tokenizer"]
        if not tok.is_file():
            raise DataError(f"tokenizer file {tok} is missing; {_FIX}")
        splits = {}
        for name, f in files.items():
            n = meta["splits"][name]["tokens"]
            splits[name] = np.memmap(f, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype=dtype)
        return cls(root, meta, splits)

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
        """The token ids of split ``train`` or ``val`` (a read-only memory map)."""
        if name not in self.splits:
            raise KeyError(f"unknown split {name!r}; choose one of {sorted(self.splits)}")
        return self.splits[name]

    def doc_offsets(self, name: str) -> np.ndarray:
        """Start offset of every document of split ``name`` in its token array."""
        f = self.path / f"{name}_docs.npy"
        if not f.is_file():
            raise DataError(f"document index {f} is missing; {_FIX}")
        return np.load(f, allow_pickle=False)

    def load_tokenizer(self) -> Any:
        """The dataset's tokenizer (a ``tokenizers.Tokenizer``)."""
        from foldtrain.data.tokenizer import load_tokenizer  # noqa: PLC0415 (keeps `tokenizers` off the training import path)

        return load_tokenizer(self.tokenizer_path)


def _rows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (len(starts), seq_len); y is x shifted by one token."""
    buf = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    t = torch.from_numpy(buf)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class SequenceSampler:
    """Non-overlapping training sequences, visited in a fresh seeded order every epoch.

    The split is cut into ``n = (len(tokens) - 1) // seq_len`` samples; sample
    ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``. Epoch ``e`` visits
    them in the order ``default_rng(seed + e).permutation(n)``; epochs are
    concatenated into one stream and step ``s`` of a global batch ``G`` is
    stream positions ``[s*G, (s+1)*G)``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n = (len(tokens) - 1) // seq_len if len(tokens) else 0
        if self.n == 0:
            raise DataError(
                f"the training split has {len(tokens)} tokens, too few for one sequence of {seq_len}+1; "
                f"use a smaller --train.seq_len or more data"
            )
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.n

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch`` (cached for the two most recent epochs)."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.n)
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at stream positions ``[start, stop)``, across epoch boundaries."""
        if start < 0 or stop < start:
            raise ValueError(f"invalid stream range [{start}, {stop})")
        pos = np.arange(start, stop, dtype=np.int64)
        epochs = pos // self.n
        out = np.empty(len(pos), dtype=np.int64)
        for e in np.unique(epochs).tolist():
            mask = epochs == e
            out[mask] = self.permutation(e)[pos[mask] - e * self.n]
        return out

    def epoch(self, step: int, global_batch: int) -> float:
        """Fractional epoch reached at the start of ``step``."""
        return step * global_batch / self.n

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for the given sample indices."""
        return _rows(self.tokens, np.asarray(indices, dtype=np.int64) * self.seq_len, self.seq_len)

    def global_batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of ``step``: (x, y), each of shape (global_batch, seq_len), int64."""
        return self.batch(self.indices(step * global_batch, (step + 1) * global_batch))

    def rank_rows(self, global_batch: int, rank: int, world: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of the global batch that belong to ``rank`` of ``world``."""
        if world <= 0 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} data-parallel ranks")
        per = global_batch // world
        return rank * per, (rank + 1) * per

    def rank_batch(self, step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous rows of the global batch of ``step``, built without the other rows."""
        lo, hi = self.rank_rows(global_batch, rank, world)
        base = step * global_batch
        return self.batch(self.indices(base + lo, base + hi))


def val_batches(tokens: np.ndarray, seq_len: int, batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: the first ``n_batches * batch`` samples, in order.

    Only full batches are returned, up to ``n_batches``; if the split holds
    fewer than ``batch`` samples, one smaller batch of all of them.
    """
    if seq_len <= 0 or batch <= 0 or n_batches <= 0:
        raise ValueError(f"seq_len, batch and n_batches must be positive, got {seq_len}, {batch}, {n_batches}")
    n = (len(tokens) - 1) // seq_len if len(tokens) else 0
    if n == 0:
        raise DataError(
            f"the validation split has {len(tokens)} tokens, too few for one sequence of {seq_len}+1; "
            f"use a smaller --train.seq_len or a larger --data.val_fraction"
        )
    count = min(n_batches, n // batch)
    if count == 0:
        return [_rows(tokens, np.arange(n, dtype=np.int64) * seq_len, seq_len)]
    return [_rows(tokens, np.arange(b * batch, (b + 1) * batch, dtype=np.int64) * seq_len, seq_len) for b in range(count)]
