"""FSDP2 on gloo (``foldtrain/parallel/fsdp_gloo.py``): the in-place reduce-scatter frees its input, and with
the backward prefetch off a rank holds one gathered block at a time in the backward, not two. One process, a
one-rank gloo group (FSDP2 still gathers and prefetches there)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from foldtrain.config import build_config
from foldtrain.parallel.fsdp_gloo import InPlaceReduceScatter, ReleasedAllGather, fit_fsdp_to_gloo
from foldtrain.train.trainer import build_model
from tests.conftest import TINY_ARGS


def test_the_reduce_scatter_keeps_the_slice_and_frees_its_input(gloo_group):
    rs = InPlaceReduceScatter()
    full = rs.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    full.copy_(torch.arange(6.0))
    out = torch.empty(6)
    rs(output_tensor=out, input_tensor=full, group=gloo_group, op=dist.ReduceOp.SUM)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # one rank: its slice is everything, summed once
    assert full.untyped_storage().nbytes() == 0
    with pytest.raises(NotImplementedError):
        rs(output_tensor=out, input_tensor=out.clone(), group=gloo_group, op=dist.ReduceOp.SUM, async_op=True)


def test_the_all_gather_returns_once_the_worker_has_let_go_of_its_output(gloo_group, monkeypatch):
    """gloo's worker thread drops its views of an all-gather's output only after the caller has been told the
    collective is done. Here a stand-in worker keeps a view for 50 ms after gloo's all-gather returns: the
    all-gather returns once the storage is referenced by the caller alone (its use count as before the call)."""
    import threading

    from foldtrain import collectives

    real = collectives.all_gather_single

    def slow_to_let_go(output_tensor, input_tensor, group=None, async_op=False):
        real(output_tensor, input_tensor, group=group)
        view = output_tensor.view(-1)[:1]
        threading.Timer(0.05, view.untyped_storage).start()  # holds ``view`` until it fires
        del view

    monkeypatch.setattr(collectives, "all_gather_single", slow_to_let_go)
    ag = ReleasedAllGather()
    out = ag.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    before = torch._C._storage_Use_Count(out.untyped_storage()._cdata)
    start = time.monotonic()
    ag(output_tensor=out, input_tensor=torch.arange(6.0), group=gloo_group)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert torch._C._storage_Use_Count(out.untyped_storage()._cdata) == before
    assert time.monotonic() - start >= 0.04
    with pytest.raises(NotImplementedError):
        ag(output_tensor=out, input_tensor=torch.arange(6.0), group=gloo_group, async_op=True)


def most_blocks_gathered_in_backward(fit: bool) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(
        build_config([*TINY_ARGS, "--model.n_layer", "4", "--model.vocab_size", "64", "--train.seq_len", "8"])
    )
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if fit:
        fit_fsdp_to_gloo([*model.blocks, model], mesh.get_group())
    seen: list[int] = []

    def count(*_):
        groups = [fully_shard.state(b)._fsdp_param_group for b in model.blocks]
        # gathered, or its all-gather's output held (a prefetch is waited for only when its unit's backward starts)
        seen.append(sum(g.is_unsharded or g._all_gather_result is not None for g in groups))

    for block in model.blocks:  # ln1's backward is the block's last: it is gathered, the next one prefetched
        block.ln1.register_full_backward_hook(count)
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx).backward()
    assert len(seen) == len(model.blocks)
    return max(seen)


def test_without_the_backward_prefetch_one_block_is_gathered_at_a_time(gloo_group):
    assert most_blocks_gathered_in_backward(fit=False) == 2  # FSDP2's own: the next block is prefetched
    assert most_blocks_gathered_in_backward(fit=True) == 1
