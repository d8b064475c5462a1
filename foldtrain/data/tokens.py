"""Token arrays that span several files: ``ShardedTokens`` (shards read as one array) and
``Blend`` (several datasets' splits mixed by weight, for ``--data.mix``).

``ShardedTokens`` behaves like the one memory-mapped array of the one-file format for what the
sampler, validation and generation use: ``len``, ``shape``, ``dtype``, integer and slice
indexing, and fancy indexing with an integer array (positions may cross shard boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class ShardedTokens:
    """The concatenation of read-only token arrays (memory maps of the shards), never copied whole."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.bounds = np.cumsum([0] + [len(p) for p in self.parts], dtype=np.int64)
        self.dtype = parts[0].dtype if parts else np.dtype("<u2")

    def __len__(self) -> int:
        return int(self.bounds[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _gather(self, pos: np.ndarray) -> np.ndarray:
        flat = pos.reshape(-1)
        n = len(self)
        if flat.size and (flat.min() < -n or flat.max() >= n):
            raise IndexError(f"token index out of range for {n} tokens")
        flat = np.where(flat < 0, flat + n, flat)
        shard = np.searchsorted(self.bounds, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(shard).tolist():
            m = shard == s
            out[m] = self.parts[s][flat[m] - self.bounds[s]]
        return out.reshape(pos.shape)

    def __getitem__(self, key: object) -> np.ndarray | np.integer:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self._gather(np.arange(start, stop, step, dtype=np.int64))
            chunks = []
            for s, part in enumerate(self.parts):
                lo, hi = max(start, int(self.bounds[s])), min(stop, int(self.bounds[s + 1]))
                if lo < hi:
                    chunks.append(np.asarray(part[lo - self.bounds[s] : hi - self.bounds[s]]))
            return np.concatenate(chunks) if chunks else np.zeros(0, dtype=self.dtype)
        if isinstance(key, (int, np.integer)):
            return self._gather(np.asarray([key], dtype=np.int64))[0]
        return self._gather(np.asarray(key, dtype=np.int64))

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


@dataclass
class Blend:
    """Splits of several datasets mixed by weight (see ``sampler.BlendIndex`` for the order)."""

    parts: list[np.ndarray | ShardedTokens]
    weights: list[float]
    names: list[str]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)
