"""The distributed optimizer's checkpoint rectangles: a flat range of a parameter's local block as at most three
rectangles of its shape, and the rest of the full tensor tiled around them (the ShardedTensor metadata)."""

from __future__ import annotations

import itertools
import random

import torch

from foldtrain.parallel.pipeline.zero_pieces import complement, rectangles


def _cover(size, rects) -> torch.Tensor:
    """How many of ``rects`` (``(offsets, sizes)``) cover each element of a tensor of ``size``."""
    n = torch.zeros(size, dtype=torch.int64)
    for off, sz in rects:
        n[tuple(slice(o, o + s) for o, s in zip(off, sz))] += 1
    return n


def test_a_flat_range_is_at_most_three_rectangles_in_order():
    shape = (5, 7)
    flat = torch.arange(35).view(shape)
    for start, end in itertools.combinations(range(36), 2):
        rects = rectangles(start, end, shape)
        assert 1 <= len(rects) <= 3
        got = torch.cat([flat[o[0] : o[0] + s[0], o[1] : o[1] + s[1]].reshape(-1) for o, s, _, _ in rects])
        assert torch.equal(got, torch.arange(start, end)), (start, end, rects)
        spans = [(a, z) for *_, a, z in rects]  # flat spans, one after another
        assert spans[0][0] == start and spans[-1][1] == end and all(p[1] == q[0] for p, q in zip(spans, spans[1:]))
    assert rectangles(3, 9, (12,)) == [((3,), (6,), 3, 9)]


def test_the_rectangles_and_their_complement_tile_the_full_tensor_once():
    """A TP rank's block anywhere in the full tensor, any flat range of it: every element covered exactly once."""
    rng = random.Random(0)
    for _ in range(300):
        if rng.random() < 0.3:
            size = (rng.randint(1, 40),)
            local = (rng.randint(1, size[0]),)
            offset = (rng.randint(0, size[0] - local[0]),)
        else:
            size = (rng.randint(1, 9), rng.randint(1, 9))
            local = (rng.randint(1, size[0]), rng.randint(1, size[1]))
            offset = (rng.randint(0, size[0] - local[0]), rng.randint(0, size[1] - local[1]))
        n = 1
        for d in local:
            n *= d
        start = rng.randint(0, n - 1)
        end = rng.randint(start + 1, n)
        mine = [(tuple(o + g for o, g in zip(off, offset)), sz) for off, sz, _, _ in rectangles(start, end, local)]
        rest = complement(local, offset, size, start, end)
        assert torch.equal(_cover(size, mine + rest), torch.ones(size, dtype=torch.int64)), (size, local, offset)
