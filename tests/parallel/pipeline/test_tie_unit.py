"""The tie's row bookkeeping and the reducer's waits, without a process group (the distributed
behaviour is in test_pipeline.py: every equivalence case checks both tied copies bit for bit)."""

from types import SimpleNamespace

import torch

from foldtrain.parallel.pipeline.reducer import ChunkReducer
from foldtrain.parallel.pipeline.tie import TieSide


def _topo(dp: int = 1):
    return SimpleNamespace(dp=dp, pp=2, rank=0, tie_group=None, dp_group=None, pipeline_peer=lambda p: p)


def test_the_embedding_end_sends_the_rows_of_its_shard_of_the_steps_tokens():
    """A vocabulary shard (rows 8..15 of 32, as a TP rank holds it): the rows are the step's distinct
    tokens inside the shard, shifted to local indices, sorted; dense once they are more than half."""
    tie = TieSide(head=False, topo=_topo(), wait=None, row_offset=8)
    tie.set_tokens(6)
    tie.begin([torch.tensor([[3, 9, 9]]), torch.tensor([[15, 12, 40]])])
    g = torch.zeros(8, 4)
    g[[1, 4, 7]] = 1.0  # tokens 9, 12, 15
    tie.launch(g)
    assert tie.rows.tolist() == [1, 4, 7] and tie.last_rows == 3
    assert torch.equal(tie.packed, torch.ones(3, 4))
    assert tie.sparse(16) and not tie.sparse(11)  # 2 T <= rows: the exchange's messages are the sparse ones
    tie.state = "idle"
    tie.begin([torch.tensor([[8, 9, 10, 11, 12]])])  # 5 of 8 rows: dense
    tie.launch(torch.zeros(8, 4))
    assert tie.rows is None and tie.last_rows is None


def test_more_tokens_than_the_configured_batch_is_a_clear_error():
    tie = TieSide(head=False, topo=_topo(dp=2), wait=None)
    tie.set_tokens(4)
    try:
        tie.begin([torch.zeros(1, 3, dtype=torch.int64)])  # 3 tokens x 2 replicas > 4
    except ValueError as e:
        assert "--train.global_batch x --train.seq_len" in str(e)
    else:
        raise AssertionError("no error")


class _Work:
    """A gloo point-to-point work: never reports completion before wait()."""

    def __init__(self):
        self.waited = False

    def is_completed(self):
        return False

    def wait(self, timeout=None):
        self.waited = True


def test_point_to_point_waits_do_not_poll_the_deadline_queue():
    """Polling is_completed() of a gloo send/receive would spin until every deferred bucket is issued;
    the reducer polls only for collectives."""
    r = ChunkReducer(0, [torch.nn.Parameter(torch.zeros(2))], None, _topo(dp=2), 5.0, True)
    calls = []

    def pump():
        calls.append(1)
        return len(calls) < 3  # deferred buckets left to issue for two polls

    r.queue = SimpleNamespace(group=object(), pump=pump)
    w = _Work()
    r._wait(w, "exchange", p2p=True)
    assert w.waited and calls == []
    w = _Work()
    r._wait(w, "all-reduce")
    assert w.waited and len(calls) == 3
