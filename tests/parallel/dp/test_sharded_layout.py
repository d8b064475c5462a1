"""sharded-ps' shard layout (buckets cut into slices), without a process group."""

from __future__ import annotations

import torch

from foldtrain.parallel.dp.sharded_ps import Bucket, Part


def test_slices_cover_the_padded_stream_in_multiples_of_the_world():
    params = [torch.zeros(5, 7), torch.zeros(3), torch.zeros(11)]
    part = Part([0, 1, 2], params, world=4, slice_elems=10)  # 49 elements, padded to 52, slices of 8
    assert part.n == 49 and part.padded == 52 and not part.ramp
    assert part.slices == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 48), (48, 52)]
    assert part.width == 13 and [q for *_, q in part.cols()] == [2] * 6 + [1]
    assert part.covering(6, 18) == [(0, 6, 18)] and part.covering(34, 40) == [(0, 34, 35), (1, 0, 3), (2, 0, 2)]


def test_one_big_parameter_ramps_its_slices_up():
    """The embedding's part: a first slice 1/64 of the full one, then doubling up to it; rank r's row is the
    r-th quarter of every slice, and rows and stream convert both ways."""
    emb = torch.arange(4 * 1000, dtype=torch.float32).view(1000, 4)
    part = Part([0], [emb], world=4, slice_elems=1024)
    lengths = [b - a for a, b in part.slices]
    assert part.ramp and lengths == [16, 16, 32, 64, 128, 256, 512, 1024, 1024, 928]
    assert part.slices[0][0] == 0 and part.slices[-1][1] == part.padded == 4000
    assert all(n % 4 == 0 for n in lengths)
    # every slice but the first fits in the part of the stream before it (where it receives)
    assert all(b - a <= a for a, b in part.slices[1:])
    stream = emb.reshape(-1)
    rows = part.to_rows(stream)
    assert rows.shape == (4, 1000) and torch.equal(part.from_rows(rows), stream)
    a, b = part.slices[3]
    assert torch.equal(rows[2, 16 // 4 + 16 // 4 + 32 // 4 :][: (b - a) // 4], stream[a:b].view(4, -1)[2])


def test_bucket_rows_keep_decay_and_plain_apart():
    params = [torch.randn(6, 4), torch.randn(5), torch.randn(3, 3)]
    b = Bucket([0, 1, 2], params, world=2, dec_off=0, plain_off=0, col_off=0, slice_elems=8)
    assert b.decay.idx == [0, 2] and b.plain.idx == [1] and b.width == b.dp + b.pp == 17 + 3
    rows = b.rows(params, torch.float32)
    out = [torch.zeros_like(p) for p in params]
    b.unpack(rows, out)
    assert all(torch.equal(x, y) for x, y in zip(out, params))
