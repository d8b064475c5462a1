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
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from foldtrain.config import build_config
from foldtrain.data import SequenceSampler, TokenData, resolve_data
from foldtrain.model import GPT, GPTShape


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main(argv: list[str]) -> int:
    cfg = build_config(argv)
    t, o, par = cfg.train, cfg.optim, cfg.parallel
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    use_cuda = torch.cuda.is_available() and t.device != "cpu"
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    rank = int(os.environ["RANK"])
    D, P = par.dp, par.pp
    rows = t.global_batch // D
    M = par.microbatches or rows // (t.micro_batch or 1)
    micro = rows // M
    data = TokenData.open(resolve_data(cfg.data))
    torch.manual_seed(t.seed)
    model = GPT(GPTShape.from_config(cfg.model))
    head = model.parts[-1]
    head.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.detach().clone())
    topo = ProcessTopology(axes=["data", "pipe"], dims=[D, P])
    net = PipelineModule(layers=list(model.parts), loss_fn=loss_fn, topology=topo, partition_method="parameters")
    ds_config = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": M,
        "gradient_clipping": o.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                  "weight_decay": o.weight_decay}},
        "bf16": {"enabled": cfg.precision.startswith("bf16")},
        "fp16": {"enabled": cfg.precision.startswith("fp16")},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           config=ds_config)
    d = rank // P
    sampler = SequenceSampler(data.split("train"), t.seq_len, t.seed)
    out = Path(cfg.out)
    metrics = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = open(out / "metrics.jsonl", "w")
    for step in range(t.steps):
        t0 = time.perf_counter()
        x, y = sampler.rank_batch(step, t.global_batch, d, D)
        it = iter([(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) for i in range(M)])
        loss = engine.train_batch(data_iter=it)
        dt = time.perf_counter() - t0
        if metrics is not None:
            mem = torch.cuda.max_memory_allocated() / 2**20 if use_cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rec = {"step": step + 1, "loss": float(loss), "tokens_per_s": t.global_batch * t.seq_len / dt, "step_time_s": dt,
                   "peak_mem_mb": mem}
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
    if metrics is not None:
        metrics.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
