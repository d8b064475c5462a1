"""The communication counters against the bytes that really left each rank's network interface.

Two emulated nodes (network namespaces, one rank each) so that every byte a rank sends crosses
its own NIC; the counters are algorithmic (a ring all-reduce of n bytes on 2 ranks: n each way;
a parameter server's push and pull: the exact payload) and the NIC adds TCP/IP headers and
acknowledgements on top: a few percent.
"""

from __future__ import annotations

import json

from foldtrain.netem.cluster import EmulatedCluster
from tests.netem.test_cluster import needs_root
from tests.support import ROOT

STRATEGIES = ["allreduce", "ddp", "ps", "sharded-ps"]  # sharded-ps: reduce-scatter + all-gather, (W-1)/W each


@needs_root
def test_counted_bytes_match_the_wire(tmp_path):
    with EmulatedCluster(2, "10gbit", name_prefix=f"ftb{abs(hash(str(tmp_path))) % 10000}") as c:
        res = c.run_torchrun(
            [str(ROOT / "tests/parallel/dp/bytes_worker.py"), str(tmp_path), ",".join(STRATEGIES)],
            env={"PYTHONPATH": str(ROOT)},
            timeout_s=240,
            log_dir=tmp_path / "logs",
        )
    assert res.ok, res.text()[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"bytes_rank{rank}.json").read_text())
        for strategy in STRATEGIES:
            counted, sent = got[strategy]["counted"], got[strategy]["sent"]
            assert counted > 100_000, (rank, strategy, counted)  # the gradients (~100k parameters), not just scalars
            assert 1.0 <= sent / counted <= 1.15, (
                f"rank {rank} {strategy}: counted {counted:.0f} B, the NIC sent {sent} B"
            )
