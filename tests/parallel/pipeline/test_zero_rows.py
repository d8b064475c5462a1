"""The distributed optimizer's slices in one process (``foldtrain/parallel/pipeline/zero.py``), on a one-rank gloo
group: ``--optim.shard_tied``'s lookup-only copy (after a step the embedding's copy of the tied weight takes only the
rows the next forward looks up) and a step whose all-gather is held (the rules' ``gather_order``). With several ranks
the 3D equivalence cases (``zero``, ``zero-tied``) hold every step against one process."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from foldtrain.parallel.pipeline.zero import ChunkShards, FlatShard, looked_up_only


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


def test_a_held_step_starts_its_all_gather_only_when_released(gloo_group):
    """``ChunkShards.step(hold=True)`` (the rules' ``gather_order``): the slice steps, but the chunk's weights keep
    their old values and nothing is in flight until ``start_gathers``; a read before then starts it (``land``)."""
    chunk = nn.Linear(4, 3).to(torch.bfloat16)  # half weights: fp32 masters, pushed even at dp = 1
    topo = SimpleNamespace(dp=1, dp_rank=0, dp_group=gloo_group, tp=1, pp_rank=0)
    optim = SimpleNamespace(shard_tied=False, weight_decay=0.0, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    before = [p.detach().clone() for p in chunk.parameters()]

    def stepped(hold):
        shards = ChunkShards(chunk, None, topo, optim)
        for p in chunk.parameters():
            p.grad = torch.ones_like(p)
        shards.pull()
        shards.step(hold)
        return shards

    held = stepped(True)
    assert not held.pushed and held.held and held.pending()
    assert all(torch.equal(p, b) for p, b in zip(chunk.parameters(), before))
    held.start_gathers()
    assert held.pushed and not held.held
    held.land(wait=lambda w: w.wait())
    after = [p.detach().clone() for p in chunk.parameters()]
    assert all(not torch.equal(p, b) for p, b in zip(after, before))
    unheld = stepped(False)  # a second step, not held: in flight at once
    assert unheld.pushed and not unheld.held
    stepped(True).land(wait=lambda w: w.wait())  # a read of a held chunk starts its all-gather itself
    assert all(not torch.equal(p, a) for p, a in zip(chunk.parameters(), after))
