"""``--optim.shard_tied``'s lookup-only copy (``foldtrain/parallel/pipeline/zero.py``): after a step the embedding's
copy of the tied weight takes only the rows the next forward looks up. One process, a one-rank gloo group; with
several ranks the 3D equivalence cases (``zero-tied``) hold every step against one process."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from foldtrain.parallel.pipeline.zero import FlatShard, looked_up_only


def test_the_rows_looked_up_take_the_stepped_values_and_the_others_wait(gloo_group):
    weight = nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))  # half weights: the slice is an fp32 master
    shard = FlatShard([weight], dp=1, dp_rank=0, group=gloo_group, tp=1)
    (seg,) = shard.segments
    seg.tensor.copy_(torch.arange(24.0))  # as if stepped
    shard.land_rows(shard.start_rows(torch.tensor([[4, 1], [1, 4]]).unique()), wait=lambda w: w.wait())
    rows = weight.detach().float()
    assert rows[1].tolist() == [4.0, 5.0, 6.0, 7.0] and rows[4].tolist() == [16.0, 17.0, 18.0, 19.0]
    assert rows[[0, 2, 3, 5]].abs().sum() == 0  # not looked up: behind until a whole all-gather
    shard.land(shard.push(), wait=lambda w: w.wait())
    assert torch.equal(weight.detach().float().reshape(-1), torch.arange(24.0))


def test_only_an_embedding_copy_without_tensor_parallelism_is_looked_up_only():
    from foldtrain.config import build_config
    from foldtrain.train.trainer import build_model
    from tests.conftest import TINY_ARGS

    model = build_model(build_config([*TINY_ARGS, "--train.seq_len", "8"]))
    tied = model.embedding.wte.weight
    first, last = nn.ModuleList(model.parts[:2]), nn.ModuleList(model.parts[-2:])
    one, two = SimpleNamespace(tp=1), SimpleNamespace(tp=2)
    assert looked_up_only(first, tied, one) and not looked_up_only(first, tied, two)
    assert not looked_up_only(last, tied, one)  # the head projects with it
    assert not looked_up_only(model, tied, one) and not looked_up_only(first, None, one)
