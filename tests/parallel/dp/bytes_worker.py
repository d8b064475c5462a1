"""Worker for test_comm_bytes.py: one rank per emulated node. Runs a few steps of each strategy and
records the bytes its ``CommStats`` counted next to the bytes its network interface actually sent."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from foldtrain.config import build_config, dp_workers
from foldtrain.distributed import init_distributed
from foldtrain.engine import build_engine
from foldtrain.model import GPT, GPTShape
from tests.parallel.dp.dp_worker import BASE
from tests.support import SyntheticSampler

STEPS = 3


def nic_tx_bytes() -> int:
    return int(Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes").read_text())


def main(out: Path, strategies: list[str]) -> None:
    env = init_distributed("cpu", 60)
    result = {}
    for strategy in strategies:
        cfg = build_config([*BASE, "--model.d_model", "64", "--dp.strategy", strategy])
        torch.manual_seed(0)
        engine = build_engine(
            cfg, GPT(GPTShape.from_config(cfg.model)), env, cfg.train.global_batch // dp_workers(cfg, env.world_size)
        )
        sampler = SyntheticSampler(cfg.model.vocab_size, cfg.train.seq_len)
        engine.train_step(*engine.batch(sampler, 0))  # connections are set up on first use
        engine.flush()  # sharded-ps: its all-gathers land in the next forward; count whole steps on both sides
        dist.barrier()
        counted, before = 0.0, nic_tx_bytes()
        for step in range(1, 1 + STEPS):
            engine.train_step(*engine.batch(sampler, step))
            if step == STEPS:
                engine.flush()  # what it sends counts in this last step's counter (reset only when a step starts)
            counted += engine.stats()["comm_bytes_sent"]
        dist.barrier()  # every byte handed to the kernel has been received by the peer, so it left the NIC
        sent = nic_tx_bytes() - before
        result[strategy] = {"counted": counted, "sent": sent}
        del engine  # its hooks and any async work go now, not at interpreter exit after the group is destroyed
        gc.collect()
    (out / f"bytes_rank{env.rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
