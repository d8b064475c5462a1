"""How many fp32 ``(b, L, V)`` tensors the resident peak of real training steps holds at the loss."""

from __future__ import annotations

from .compute import _fit_cluster

LOSS_SHAPE = dict(n_layer=2, n_head=4, d_model=96, context=128, vocab_size=8192)  # tiny's width and vocabulary
LOSS_TOKENS = (512, 2048)
REPEATS = 2


def _loss_probe(tokens: int, queue) -> None:
    """Peak resident size of 16 real training steps (forward, loss, backward, fused AdamW) at ``tokens``
    tokens per step, with the host allocator set up as a CPU training process sets it."""
    import resource

    import torch

    from foldtrain.hostmem import keep_freed_host_memory
    from foldtrain.model.gpt import GPT, GPTShape, lm_loss

    torch.set_num_threads(1)
    keep_freed_host_memory()
    sh = LOSS_SHAPE
    m = GPT(GPTShape(sh["n_layer"], sh["n_head"], sh["d_model"], sh["context"], sh["vocab_size"]))
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    x = torch.randint(0, sh["vocab_size"], (tokens // sh["context"], sh["context"]))
    for _ in range(16):
        lm_loss(m(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def measure_loss_buffers() -> float:
    """How many fp32 ``(b, L, V)`` tensors the resident peak holds per token beyond the activations the cost
    model counts: the slope of the peak resident size of real training steps between two token counts
    (fresh processes, twice), less the model's activation bytes per token, over ``V * 4``. 3 are live at the
    loss's backward; a host allocator that keeps freed blocks shows more."""
    import multiprocessing as mp

    from foldtrain.config import build_config
    from foldtrain.sim.costs import CostModel
    from foldtrain.sim.setup import resolve_setup

    ctx = mp.get_context("spawn")
    peaks = [0.0, 0.0]
    for _ in range(REPEATS):  # where holes form depends on the order of events: average a few processes
        for i, tokens in enumerate(LOSS_TOKENS):
            q = ctx.Queue()
            p = ctx.Process(target=_loss_probe, args=(tokens, q))
            p.start()
            peaks[i] += q.get(timeout=600) / REPEATS
            p.join()
    sh = LOSS_SHAPE
    cfg = build_config(
        [
            "--model.n_layer",
            str(sh["n_layer"]),
            "--model.n_head",
            str(sh["n_head"]),
            "--model.d_model",
            str(sh["d_model"]),
            "--model.context",
            str(sh["context"]),
            "--model.vocab_size",
            str(sh["vocab_size"]),
            "--train.seq_len",
            str(sh["context"]),
            "--train.global_batch",
            "1",
        ]
    )
    cm = CostModel(resolve_setup(cfg), _fit_cluster())  # only its activation sizes are read
    act_per_token = (sh["n_layer"] * cm.act_bytes_block(recompute=False) + cm.activation_bytes()) / sh["context"]
    slope = (peaks[1] - peaks[0]) / (LOSS_TOKENS[1] - LOSS_TOKENS[0])
    return max((slope - act_per_token) / (sh["vocab_size"] * 4), 1.0)
