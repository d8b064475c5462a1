"""What the equivalence tests share: an N-rank run is compared with a single-process run of the same global batch.

* error measures, each named after what it measures: ``norm_rel`` (2-norm of a tensor), ``max_rel`` (largest
  element), ``scalar_rel`` (a loss, a gradient norm), and the worst parameter tensor by ``norm_rel``;
* the attention key biases, which every fp32 parameter comparison leaves out (``key_bias_mask``);
* deterministic synthetic token batches (``token_batches``);
* the pipeline tests' setting: the config of a case's layout (``make_cfg``), its batches, the single-process
  reference run and the comparison with it (``compare``).

The trainer-facing sampler (batches seeded by the step, sliced per rank) is ``tests.support.SyntheticSampler``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tests.parallel.pipeline.cases import MICRO, STEPS, M

# ---------------------------------------------------------------------- error measures


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into the whole tensor (on every rank); any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in the 2-norm over the whole tensor, in float64: how far a tensor is from the reference b."""
    a, b = full(a).detach().double(), full(b).detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the largest entry of the reference b, in float64: the worst single element.
    Tensors of different shapes are infinitely far apart."""
    a, b = full(a).detach().double(), full(b).detach().double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _number(x) -> float:
    return float(full(x).detach()) if isinstance(x, torch.Tensor) else float(x)


def scalar_rel(a, b) -> float:
    """|a - b| / |b| of two numbers (Python numbers or one-element tensors, DTensors included)."""
    a, b = _number(a), _number(b)
    return abs(a - b) / max(abs(b), 1e-12)


def key_bias_mask(n_head: int, d_model: int) -> torch.Tensor:
    """Entries of ``attn.qkv.bias`` that are key biases (head-major layout [head][q|k|v][head_dim]).

    The loss does not depend on them (softmax is invariant to adding q·b_k to a whole row), so
    their gradient is pure rounding noise that AdamW normalises into full-size steps of random
    sign, different in any two summation orders. Equivalence tests compare every other entry to
    their tolerance and check these only in float64.
    """
    m = torch.zeros(n_head, 3, d_model // n_head, dtype=torch.bool)
    m[:, 1] = True
    return m.reshape(-1)


def without_key_bias(name: str, t: torch.Tensor, n_head: int, d_model: int) -> torch.Tensor:
    """``t`` without its key-bias entries if ``name`` is an ``attn.qkv.bias``, else ``t``."""
    if not name.endswith("attn.qkv.bias"):
        return t
    return t.reshape(-1)[~key_bias_mask(n_head, d_model).to(t.device)]


def param_errors(got: dict, ref: dict, n_head: int, d_model: int) -> dict[str, float]:
    """``norm_rel`` of every tensor of the reference state ``ref`` (in its order), key biases left out."""
    return {
        name: norm_rel(without_key_bias(name, got[name], n_head, d_model), without_key_bias(name, b, n_head, d_model))
        for name, b in ref.items()
    }


def worst_param(got: dict, ref: dict, n_head: int, d_model: int) -> tuple[float, str]:
    """The largest ``param_errors`` entry and its tensor's name (the first such tensor on a tie)."""
    errs = param_errors(got, ref, n_head, d_model)
    name = max(errs, key=errs.get, default="")
    return errs.get(name, 0.0), name


# ---------------------------------------------------------------------- synthetic data


def token_batches(
    steps: int, rows: int, seq_len: int, vocab: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (inputs, next-token targets) pairs of ``rows`` x ``seq_len`` tokens drawn uniformly from
    ``vocab`` by a generator seeded with ``seed``: the same batches for the same arguments, in any process."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (steps, rows, seq_len + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


# ---------------------------------------------------------------------- the pipeline tests' setting
# A case (tests/parallel/pipeline/cases.py) names a layout (dp, pp, tp, virtual) and a schedule; every case
# trains a small GPT on CPU and is compared with the single-process engine on the same global batch.

VOCAB, SEQ, D, HEADS = 64, 8, 16, 2
DEVICE = torch.device("cpu")


def make_cfg(c: dict, steps: int = STEPS, out: str = "", **over):
    """The config of case ``c``: its layout, schedule and options on the small model, ``over`` on top; ``out``: the
    run directory (none by default)."""
    from foldtrain.config import build_config

    dp, pp, tp, v = c["layout"]
    clip = c.get("clip", 0.0 if c.get("defer") else c.get("grad_clip", 1.0))
    args = {
        "model.n_layer": c.get("n_layer", 8),
        "model.n_head": HEADS,
        "model.d_model": D,
        "model.context": 16,
        "model.vocab_size": c.get("vocab") or c.get("vocab_pad") or VOCAB,
        "train.seq_len": SEQ,
        "train.steps": steps,
        "train.global_batch": dp * c.get("m", M) * MICRO,
        "train.micro_batch": MICRO,
        "optim.lr": 1e-2,
        "optim.min_lr": 1e-3,
        # AdamW normalises each entry by its own root mean square: at eps 1e-8 an entry whose gradient nearly
        # cancels turns a different summation order's rounding into a learning-rate-sized step (docs/testing.md)
        "optim.eps": 1e-4,
        "optim.warmup_steps": 2,
        "optim.grad_clip": clip,
        "optim.distributed": bool(c.get("zero")),
        "optim.shard_tied": bool(c.get("shard_tied")),
        "optim.split_tied": c.get("split_tied", True),
        "parallel.dp": dp,
        "parallel.pp": pp,
        "parallel.tp": tp,
        "parallel.virtual": v,
        "parallel.schedule": c["schedule"],
        "parallel.dp_sync": c.get("dp_sync", "after-flush"),
        "fold.defer_reduce": bool(c.get("defer")),
        "precision": c.get("precision", "fp32"),
        "ac": c.get("ac", "none"),
        "dp.timeout_s": 60,
        "dp.strategy": "fsdp" if c.get("fsdp") else "none",
        "dp.compression": c.get("wire", "none"),
        "dp.reshard_after_forward": c.get("reshard", True),
        "train.device": "cpu",
    }
    if c.get("layers_per_chunk"):
        args["parallel.layers_per_chunk"] = ",".join(map(str, c["layers_per_chunk"]))
    args["out"] = out  # "": no run directory (the profiled cases keep their events in memory, write no files)
    args.update(over)
    flat = []
    for k, v in args.items():
        flat += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return build_config(flat)


def batches(global_batch: int, steps: int, seed: int = 0, vocab: int = VOCAB):
    """The training batches of a pipeline case: ``steps`` global batches of ``SEQ`` tokens."""
    return token_batches(steps, global_batch, SEQ, vocab, seed)


def val_data(vocab: int = VOCAB):
    """The evaluation batches of a pipeline case: two batches of two micro-batches."""
    return token_batches(2, 2 * MICRO, SEQ, vocab, seed=99)


def build_model(cfg, seed: int | None = None, tp: int | None = None):
    """The GPT of ``cfg``, initialised from ``seed`` (default: the config's seed), its vocabulary padded for
    ``tp`` (default: the config's, as the trainer builds it)."""
    from foldtrain.model.gpt import GPT, GPTShape

    torch.manual_seed(cfg.train.seed if seed is None else seed)
    shape = GPTShape.from_config(cfg.model, cfg.parallel.tp if tp is None else tp)
    return GPT(shape, cfg.train.seed if seed is None else seed)


_REF: dict = {}


def reference(cfg, steps: int = STEPS):
    """The single-process Engine on the same global batches and micro-batch size: (losses, final weights,
    eval loss, gradient norms), cached per setting."""
    from foldtrain.engine import ReplicatedEngine as Engine

    key = (cfg.model.n_layer, cfg.train.global_batch, cfg.optim.grad_clip, cfg.precision, steps, cfg.model.vocab_size)
    if key not in _REF:
        eng = Engine(build_model(cfg, tp=1), cfg, DEVICE, MICRO)  # one process: an unpadded vocabulary
        losses, norms = [], []
        for x, y in batches(cfg.train.global_batch, steps, vocab=cfg.model.vocab_size):
            losses.append(eng.train_step(x, y))
            norms.append(eng.last_grad_norm)
        params = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        _REF[key] = (losses, params, eng.eval_loss(val_data(cfg.model.vocab_size)), norms)
    return _REF[key]


def compare(cfg, losses: list[float], model, eval_loss: float, norms: list[float]) -> dict:
    """A pipeline run (its per-step losses and gradient norms, the whole trained ``model`` and its eval loss)
    against ``reference(cfg)``: the worst relative error of each, with both sides' values."""
    from foldtrain.model.vocab import strip_padding

    ref_losses, ref_params, ref_eval, ref_norms = reference(cfg)
    loss_err = max(scalar_rel(a, b) for a, b in zip(losses, ref_losses))
    padded = model.state_dict()
    sd = strip_padding(padded, cfg.model.vocab_size)  # the padding rows are compared with zero below
    pad = [full(t)[cfg.model.vocab_size :].abs().max() for k, t in padded.items() if t.shape != sd[k].shape]
    assert set(sd) == set(ref_params), set(sd) ^ set(ref_params)
    param_err, worst = worst_param(sd, ref_params, HEADS, D)
    # deferral steps chunks before the other chunks' gradients exist: no global norm is computed (logged 0)
    norm_err = None if cfg.fold.defer_reduce else max(scalar_rel(a, b) for a, b in zip(norms, ref_norms))
    return {
        "loss_err": loss_err,
        "param_err": param_err,
        "worst_param": worst,
        "eval_err": scalar_rel(eval_loss, ref_eval),
        "losses": losses,
        "ref_losses": ref_losses,
        "norm_err": norm_err,
        "norms": norms,
        "ref_norms": ref_norms,
        "grad_clip": cfg.optim.grad_clip,
        "padding_rows": len(pad),  # vocabulary tensors that were padded
        "padding_abs_max": float(max(pad)) if pad else 0.0,  # the padding rows never moved from zero
    }
