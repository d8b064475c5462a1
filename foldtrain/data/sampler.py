"""Batches as a pure function of the step: ``SequenceSampler`` and ``val_batches``.

``SequenceSampler`` is stateless: a batch is a pure function of ``(seed, step)``, so resuming
at a step reproduces the stream exactly, and data-parallel ranks each build only their own rows
of the global batch. It takes one token array (a memory map, or ``ShardedTokens`` spanning the
shards of a dataset: the shards are read as one stream, so a sharded dataset gives the batches
its one-file twin gives) or a ``Blend`` of several datasets (``--data.mix``).

A blend (Megatron's data blend) cuts the stream into blocks of ``BLEND_BLOCK`` positions. Each
dataset ``i`` gets ``c_i`` positions of every block (``c_i / BLEND_BLOCK`` is its weight,
rounded by largest remainder, so the proportions are exact on every block), scattered by a
seeded permutation of the block; the ``k``-th position given to dataset ``i`` takes sample ``k``
of that dataset's own sampler (its own seed, its own epochs). Position -> (dataset, sample) is
computed from the block alone, so a blend keeps every guarantee above.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from foldtrain.data.tokens import Blend
from foldtrain.errors import DataError

BLEND_BLOCK = 4096


def _rows(tokens: object, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (len(starts), seq_len); y is x shifted by one token."""
    buf = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)  # type: ignore[index]
    t = torch.from_numpy(buf)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def blend_counts(weights: list[float], names: list[str], block: int = BLEND_BLOCK) -> np.ndarray:
    """Positions per block of each dataset: ``weights`` normalized, times ``block``, largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: block - int(counts.sum())]] += 1
    for name, c, wi in zip(names, counts.tolist(), weights):
        if c == 0:
            raise DataError(
                f"--data.mix weight {wi:g} of {name} is below 1/{block} of the total; "
                "raise it or leave that dataset out"
            )
    return counts


class BlendIndex:
    """Stream position -> (dataset, k-th position of that dataset), block by block (see module docstring)."""

    def __init__(self, counts: np.ndarray, seed: int) -> None:
        self.counts, self.seed = counts, seed
        self.block = int(counts.sum())
        self._base = np.repeat(np.arange(len(counts)), counts)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _pattern(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        hit = self._cache.get(b)
        if hit is None:
            pat = np.random.default_rng([self.seed, b]).permutation(self._base)
            order = np.argsort(pat, kind="stable")
            starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
            rank = np.empty(self.block, dtype=np.int64)
            rank[order] = np.arange(self.block) - starts[pat[order]]
            hit = self._cache[b] = (pat, rank)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return hit

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        comp, k = np.empty(len(pos), dtype=np.int64), np.empty(len(pos), dtype=np.int64)
        blocks = pos // self.block
        for b in np.unique(blocks).tolist():
            m = blocks == b
            pat, rank = self._pattern(b)
            r = pos[m] - b * self.block
            comp[m] = pat[r]
            k[m] = b * self.counts[pat[r]] + rank[r]
        return comp, k


def _component_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed, i + 1]).generate_state(1)[0])


class SequenceSampler:
    """Non-overlapping training sequences, visited in a fresh seeded order every epoch.

    The split is cut into ``n = (len(tokens) - 1) // seq_len`` samples; sample
    ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``. Epoch ``e`` visits
    them in the order ``default_rng(seed + e).permutation(n)``; epochs are
    concatenated into one stream and step ``s`` of a global batch ``G`` is
    stream positions ``[s*G, (s+1)*G)``. For a ``Blend``, see the module docstring;
    its sample ids are ``offset of dataset i + sample of dataset i``.
    """

    def __init__(self, tokens: object, seq_len: int, seed: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.blend: BlendIndex | None = None
        if isinstance(tokens, Blend):
            self.components = [
                SequenceSampler(p, seq_len, _component_seed(seed, i)) for i, p in enumerate(tokens.parts)
            ]
            self.offsets = np.cumsum([0] + [c.n for c in self.components], dtype=np.int64)
            self.blend = BlendIndex(blend_counts(tokens.weights, tokens.names), seed)
            self.n = int(self.offsets[-1])
            return
        self.n = (len(tokens) - 1) // seq_len if len(tokens) else 0  # type: ignore[arg-type]
        if self.n == 0:
            raise DataError(
                f"the training split has {len(tokens)} tokens, too few for one sequence of {seq_len}+1; "  # type: ignore[arg-type]
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
        return self.at(np.arange(start, stop, dtype=np.int64))

    def at(self, pos: np.ndarray) -> np.ndarray:
        """Sample indices at the given (non-negative) stream positions."""
        out = np.empty(len(pos), dtype=np.int64)
        if self.blend is not None:
            comp, k = self.blend.locate(pos)
            for c in np.unique(comp).tolist():
                m = comp == c
                out[m] = self.offsets[c] + self.components[c].at(k[m])
            return out
        epochs = pos // self.n
        for e in np.unique(epochs).tolist():
            mask = epochs == e
            out[mask] = self.permutation(e)[pos[mask] - e * self.n]
        return out

    def epoch(self, step: int, global_batch: int) -> float:
        """Fractional epoch reached at the start of ``step`` (of the whole blend, for a blend)."""
        return step * global_batch / self.n

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for the given sample indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.blend is None:
            return _rows(self.tokens, indices * self.seq_len, self.seq_len)
        comp = np.searchsorted(self.offsets, indices, side="right") - 1
        x = torch.empty(len(indices), self.seq_len, dtype=torch.int64)
        y = torch.empty_like(x)
        for c in np.unique(comp).tolist():
            m = comp == c
            x[torch.from_numpy(m)], y[torch.from_numpy(m)] = self.components[c].batch(indices[m] - self.offsets[c])
        return x, y

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


def _blend_val(tokens: Blend, seq_len: int, batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validation of a blend: positions in the blend's order (seed 0), each dataset's samples in order."""
    ns = [(len(p) - 1) // seq_len if len(p) else 0 for p in tokens.parts]
    for name, n in zip(tokens.names, ns):
        if n == 0:
            raise DataError(
                f"the validation split of {name} is too small for one sequence of {seq_len}+1; "
                "use a smaller --train.seq_len"
            )
    index = BlendIndex(blend_counts(tokens.weights, tokens.names), 0)
    comp, k = index.locate(np.arange(batch * n_batches, dtype=np.int64))
    x = torch.empty(len(comp), seq_len, dtype=torch.int64)
    y = torch.empty_like(x)
    for c in np.unique(comp).tolist():
        m = comp == c
        x[torch.from_numpy(m)], y[torch.from_numpy(m)] = _rows(tokens.parts[c], (k[m] % ns[c]) * seq_len, seq_len)
    return [(x[b * batch : (b + 1) * batch], y[b * batch : (b + 1) * batch]) for b in range(n_batches)]


def val_batches(tokens: object, seq_len: int, batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: the first ``n_batches * batch`` samples, in order.

    Only full batches are returned, up to ``n_batches``; if the split holds
    fewer than ``batch`` samples, one smaller batch of all of them. For a blend,
    ``n_batches`` full batches mixed by weight.
    """
    if seq_len <= 0 or batch <= 0 or n_batches <= 0:
        raise ValueError(f"seq_len, batch and n_batches must be positive, got {seq_len}, {batch}, {n_batches}")
    if isinstance(tokens, Blend):
        return _blend_val(tokens, seq_len, batch, n_batches)
    n = (len(tokens) - 1) // seq_len if len(tokens) else 0  # type: ignore[arg-type]
    if n == 0:
        raise DataError(
            f"the validation split has {len(tokens)} tokens, too few for one sequence of {seq_len}+1; "  # type: ignore[arg-type]
            f"use a smaller --train.seq_len or a larger --data.val_fraction"
        )
    count = min(n_batches, n // batch)
    if count == 0:
        return [_rows(tokens, np.arange(n, dtype=np.int64) * seq_len, seq_len)]
    return [
        _rows(tokens, np.arange(b * batch, (b + 1) * batch, dtype=np.int64) * seq_len, seq_len) for b in range(count)
    ]
