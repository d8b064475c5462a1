"""sharded-ps' shard layout (buckets cut into slices), without a process group."""

from __future__ import annotations

import torch

from foldtrain.parallel.dp.shard_layout import Part, ShardBucket, ShardLayout


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
    b = ShardBucket([0, 1, 2], params, world=2, decay_off=0, plain_off=0, col_off=0, slice_elems=8)
    assert b.decay.idx == [0, 2] and b.plain.idx == [1] and b.width == b.decay_width + b.plain_width == 17 + 3
    rows = b.rows(params, torch.float32)
    out = [torch.zeros_like(p) for p in params]
    b.unpack(rows, out)
    assert all(torch.equal(x, y) for x, y in zip(out, params))


def test_every_rank_s_shards_put_together_give_the_parameters_back():
    """Each rank's decay and plain shards, laid out as its row by the buckets' offsets (as the all-gather
    sends them), make the whole model again."""
    torch.manual_seed(0)
    params = [torch.randn(40, 8), torch.randn(8), torch.randn(300, 8), torch.randn(5), torch.randn(6, 7)]
    world = 3
    rows = []
    for rank in range(world):
        lay = ShardLayout(params, world, rank, first_bytes=100, cap_bytes=2000, slice_bytes=160)
        decay, plain = lay.my_part(params, "decay"), lay.my_part(params, "plain")
        assert decay.numel() == lay.n_decay and plain.numel() == lay.n_plain
        row = torch.empty(lay.row)
        for b in lay.buckets:
            row[b.col_off : b.col_off + b.decay_width] = decay[b.decay_off : b.decay_off + b.decay_width]
            row[b.col_off + b.decay_width : b.col_off + b.width] = plain[b.plain_off : b.plain_off + b.plain_width]
        rows.append(row)
    assert len(lay.buckets) > 2 and any(b.decay.ramp for b in lay.buckets)  # the big ones alone, ramped
    assert sorted(i for index in lay.plan for i in index) == list(range(len(params))) and lay.total == 2775
    out = [torch.zeros_like(p) for p in params]
    lay.unpack(torch.stack(rows), out)
    assert all(torch.equal(x, y) for x, y in zip(out, params))
