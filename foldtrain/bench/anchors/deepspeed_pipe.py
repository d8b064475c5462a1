"""Anchor: the same GPT as a DeepSpeed ``PipelineModule`` (1F1B pipeline + data parallelism), used
only when ``import deepspeed`` works.

    torchrun --nnodes 2 --nproc_per_node 2 ... -m foldtrain.bench.anchors.deepspeed_pipe \
        --parallel.dp 2 --parallel.pp 2 --model.preset tiny --train.global_batch 16 --out DIR

The layers are the model's parts (embedding, blocks, head) in order, partitioned over
``--parallel.pp`` stages by parameter count; the topology puts the pipeline axis innermost
(global rank = d * P + p, as foldtrain's mesh), so with ``--nproc_per_node P`` each node holds a
whole pipeline and data parallelism crosses nodes. DeepSpeed's engine runs its 1F1B schedule with
``--parallel.microbatches`` M micro-batches (default: micro-batches of ``--train.micro_batch``
or 1 row) and all-reduces gradients after the flush. Tied embeddings are untied here (DeepSpeed's
``TiedLayerSpec`` would tie them; a small difference in communication). Rank 0 writes
``metrics.jsonl`` with ``step_time_s`` and ``tokens_per_s``.

The optimizer is foldtrain's AdamW (torch's, weight decay on matrices, the same warm-up + cosine
schedule) handed to ``deepspeed.initialize``: DeepSpeed's own "AdamW" would JIT-compile its
FusedAdam C++ op at start-up (minutes on a loaded CPU; the pip install builds no ops,
``DS_BUILD_OPS=0``). For the same reason its shared-memory collective op is not built: on CPU it
serves only ``inference_all_reduce``, never training (and its shared memory would cross the
emulated nodes, which share /dev/shm).

Tested with DeepSpeed 0.19.8 (the ``bench`` extra) and torch 2.13 on CPU (gloo).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from foldtrain.bench.anchors.common import (
    Metrics,
    adamw,
    data_and_model,
    loss_fn,
    lr_at,
    micro_batches,
    set_lr,
    untie_head,
)
from foldtrain.config import build_config
from foldtrain.data import SequenceSampler


def main(argv: list[str]) -> int:
    cfg = build_config(argv)
    t, o, par = cfg.train, cfg.optim, cfg.parallel
    import importlib

    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    # inference-only on CPU; see the module doc
    # (the module, not the attribute: ``deepspeed.comm.torch`` is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    use_cuda = torch.cuda.is_available() and t.device != "cpu"
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    rank = int(os.environ["RANK"])
    D, P = par.dp, par.pp
    rows = t.global_batch // D
    M = par.microbatches or rows // (t.micro_batch or 1)
    micro = rows // M
    data, model = data_and_model(cfg)
    untie_head(model.parts[-1])
    topo = ProcessTopology(axes=["data", "pipe"], dims=[D, P])
    net = PipelineModule(layers=list(model.parts), loss_fn=loss_fn, topology=topo, partition_method="parameters")
    ds_config = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": M,
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": cfg.precision.startswith("bf16")},
        "fp16": {"enabled": cfg.precision.startswith("fp16")},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    opt = adamw([p for p in net.parameters() if p.requires_grad], o, foreach=None)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=ds_config)
    d = rank // P
    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    metrics = Metrics(cfg, rank, torch.device("cuda" if use_cuda else "cpu"))  # "cuda": the current GPU's peak memory
    for step in range(t.steps):
        t0 = time.perf_counter()
        set_lr(engine.optimizer, lr_at(step, o, t.steps))
        x, y = sampler.rank_batch(step, t.global_batch, d, D)
        it = iter(micro_batches(x, y, M, micro))
        loss = engine.train_batch(data_iter=it)
        dt = time.perf_counter() - t0
        metrics.write(step, dt, loss)
    metrics.close()
    # leave together and tear the group down: a rank that exits with gloo's threads still running dies
    # in their destructors ("terminate called without an active exception", SIGABRT: 1 launch in 3 here)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
