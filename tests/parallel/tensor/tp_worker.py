"""Worker for test_tp_distributed.py, run as ``torchrun --nproc-per-node 2 tp_worker.py OUT_DIR``.

Every rank builds the same GPT (same seed), keeps a deep copy as the single-process reference and
tensor-parallelises another copy over a 2-rank gloo mesh; it then records, per check, a relative
difference (or a boolean) in ``OUT_DIR/result_rank{r}.json``: the worst element's (``max_rel``) for
tensors unless a key says ``rel2`` (the 2-norm's, ``norm_rel``), ``scalar_rel`` for losses and norms
(measures from ``tests.equivalence``). pytest asserts on those files.
Checks that raise are recorded as ``{"error": "..."}`` so one failure does not hide the others.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from foldtrain.model.gpt import GPT, GPTShape, lm_loss
from foldtrain.parallel.tensor import apply_tensor_parallel, clip_grad_norm_, grad_norm, grads_finite, tp_loss
from tests.equivalence import full, key_bias_mask, max_rel, norm_rel, scalar_rel, token_batches

SHAPE = GPTShape(n_layer=2, n_head=4, d_model=32, context=16, vocab_size=64, dropout=0.0)
B, T, STEPS, CLIP = 2, 8, 5, 1.0


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of B x T tokens, the same on every rank and in every launch."""
    return token_batches(n, B, T, SHAPE.vocab_size, seed=1234)


def optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    from foldtrain.optim import build_optimizer

    cfg = SimpleNamespace(lr=lr, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    return build_optimizer(list(model.named_parameters()), cfg)  # foreach=True, as the Engine does


def same_on_all_ranks(t: torch.Tensor) -> bool:
    t = t.detach().contiguous()
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t)
    return all(torch.equal(got[0], x) for x in got[1:])


def check_forward(res: dict, mesh) -> None:
    torch.manual_seed(0)
    ref = GPT(SHAPE)
    tp = apply_tensor_parallel(copy.deepcopy(ref), mesh)
    x, y = batches(1)[0]
    logits_ref = ref(x)
    logits = tp(x)
    res["logits_is_dtensor"] = isinstance(logits, DTensor)
    res["logits_placements"] = [str(p) for p in logits.placements] if isinstance(logits, DTensor) else None
    res["logits_local_vocab"] = int(logits.to_local().shape[-1]) if isinstance(logits, DTensor) else None
    res["forward_logits_rel"] = max_rel(logits, logits_ref)
    res["forward_loss_rel"] = scalar_rel(tp_loss(logits, y), lm_loss(logits_ref, y))
    res["tied_after_tp"] = tp.head.lm_head.weight is tp.embedding.wte.weight
    res["tied_placements"] = [str(p) for p in tp.embedding.wte.weight.placements]
    res["n_params_ref"] = len(list(ref.parameters()))
    res["n_params_tp"] = len(list(tp.parameters()))
    res["numel_full_equal"] = sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in tp.parameters())
    res["all_params_dtensor"] = all(isinstance(p, DTensor) for p in tp.parameters())
    res["placements"] = {
        n: [str(pl) for pl in p.placements] for n, p in tp.named_parameters() if isinstance(p, DTensor)
    }
    # loss_parallel (PyTorch's own vocab-parallel CE) for comparison; its backward must run inside it
    try:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            lp = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        res["loss_parallel_rel"] = scalar_rel(lp, lm_loss(logits_ref, y))
    except Exception as e:  # noqa: BLE001 - recorded, not asserted
        res["loss_parallel_rel"] = f"error: {type(e).__name__}: {e}"
    # deepcopy (the Engine's fp32 master copy) keeps the tie and the layout
    cp = copy.deepcopy(tp)
    res["deepcopy_tied"] = cp.head.lm_head.weight is cp.embedding.wte.weight
    res["deepcopy_forward_rel"] = max_rel(cp(x), logits_ref)


def check_tp_loss_unit(res: dict, mesh) -> None:
    """tp_loss value and gradient vs F.cross_entropy on a leaf vocab-sharded logits tensor (with ignored rows)."""
    g = torch.Generator().manual_seed(7)
    full_logits = torch.randn(3, 5, SHAPE.vocab_size, generator=g) * 3
    targets = torch.randint(0, SHAPE.vocab_size, (3, 5), generator=g)
    targets[0, :2] = -100
    ref_leaf = full_logits.clone().requires_grad_(True)
    ref_loss = lm_loss(ref_leaf, targets)
    ref_loss.backward()
    d = distribute_tensor(full_logits.clone(), mesh, [Shard(-1)]).requires_grad_(True)
    loss = tp_loss(d, targets)
    loss.backward()
    res["tp_loss_unit_loss_rel"] = scalar_rel(loss, ref_loss)
    res["tp_loss_unit_grad_rel"] = max_rel(d.grad, ref_leaf.grad)
    res["tp_loss_unit_plain_rel"] = scalar_rel(tp_loss(full_logits, targets), ref_loss)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """lm_loss, except that float64 logits keep float64 (lm_loss casts to float32)."""
    if logits.dtype == torch.float64:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return lm_loss(logits, targets)


def check_training(
    res: dict, mesh, out_dir: str | None, dtype: torch.dtype = torch.float32, prefix: str = "", lr: float = 1e-3
) -> None:
    """5 AdamW steps (clip 1.0) on the same batches, TP vs single process.

    A key bias has a mathematically zero gradient (softmax ignores a per-row constant), so in fp32
    its gradient is rounding noise that Adam turns into +-lr updates of arbitrary sign on either
    side; fp32 parameter comparisons therefore leave the key-bias entries out (and report them
    apart), while the float64 run compares every parameter.
    """
    res = _Prefixed(res, prefix)
    torch.manual_seed(0)
    ref = GPT(SHAPE).to(dtype)
    tp = apply_tensor_parallel(copy.deepcopy(ref), mesh)
    opt_ref, opt_tp = optimizer(ref, lr), optimizer(tp, lr)
    loss_rel, clip_norm_rel, torch_norm_rel, norms = [], [], [], []
    for step, (x, y) in enumerate(batches(STEPS)):
        loss_ref = loss_of(ref(x), y)
        loss_ref.backward()
        loss = tp_loss(tp(x), y)
        loss.backward()
        if step == 0:
            grads_rel = {
                n: max_rel(p.grad, q.grad) for (n, p), (_, q) in zip(tp.named_parameters(), ref.named_parameters())
            }
            res["step0_grad_rel_max"] = max(grads_rel.values())
            res["step0_grad_rel_worst"] = max(grads_rel, key=grads_rel.get)
            repl = {n: p for n, p in tp.named_parameters() if all(pl.is_replicate() for pl in p.placements)}
            res["replicated_param_names"] = sorted(repl)
            res["replicated_grads_identical_across_ranks"] = all(
                same_on_all_ranks(p.grad.to_local()) for p in repl.values()
            )
            res["grad_placements_match_params"] = all(
                isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in tp.parameters()
            )
            # a clip that really scales (max_norm below the norm) gives the same gradients
            ref_g = {n: p.grad.clone() for n, p in ref.named_parameters()}
            tp_g = {n: p.grad.full_tensor().clone() for n, p in tp.named_parameters()}
            n0 = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            small = 0.5 * float(n0)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), small)
            clip_grad_norm_(tp.parameters(), small)
            res["small_clip_grad_rel"] = max(max_rel(p.grad, q.grad) for p, q in zip(tp.parameters(), ref.parameters()))
            with torch.no_grad():  # restore the unclipped gradients for the run
                for n, p in ref.named_parameters():
                    p.grad.copy_(ref_g[n])
                for n, p in tp.named_parameters():
                    p.grad.copy_(distribute_tensor(tp_g[n], mesh, p.placements))
            res["restore_grad_rel"] = max(max_rel(p.grad, q.grad) for p, q in zip(tp.parameters(), ref.parameters()))
        # torch's own total norm on the DTensor grads (what Engine.clip calls)
        try:
            tn = torch.nn.utils.get_total_norm([p.grad for p in tp.parameters()], foreach=True)
            res["torch_total_norm_type"] = type(tn).__name__
            res["torch_total_norm_placements"] = [str(p) for p in tn.placements] if isinstance(tn, DTensor) else None
            torch_norm_val = float(full(tn))
        except Exception as e:  # noqa: BLE001
            res["torch_total_norm_type"] = f"error: {type(e).__name__}: {e}"
            torch_norm_val = float("nan")
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        n_tp = clip_grad_norm_(tp.parameters(), CLIP)
        res["grad_norm_is_plain"] = type(n_tp) is torch.Tensor
        opt_ref.step()
        opt_tp.step()
        opt_ref.zero_grad(set_to_none=True)
        opt_tp.zero_grad(set_to_none=True)
        loss_rel.append(scalar_rel(loss, loss_ref))
        clip_norm_rel.append(scalar_rel(n_tp, n_ref))
        torch_norm_rel.append(scalar_rel(torch_norm_val, n_ref))
        norms.append(float(n_ref))
    res["train_loss_rel"] = loss_rel
    res["train_norm_rel"] = clip_norm_rel
    res["torch_get_total_norm_rel"] = torch_norm_rel
    res["train_grad_norms"] = norms
    params_rel = {n: max_rel(p, q) for (n, p), (_, q) in zip(tp.named_parameters(), ref.named_parameters())}
    res["train_param_rel_max"] = max(params_rel.values())
    res["train_param_rel_worst"] = max(params_rel, key=params_rel.get)
    kb = key_bias_mask(SHAPE.n_head, SHAPE.d_model)
    excl, excl2 = {}, {}
    for (n, p), (_, q) in zip(tp.named_parameters(), ref.named_parameters()):
        if n.endswith("attn.qkv.bias"):
            excl[n] = max_rel(full(p)[~kb], q[~kb])
            excl2[n] = norm_rel(full(p)[~kb], q[~kb])
            res[f"train_key_bias_rel/{n}"] = max_rel(full(p)[kb], q[kb])
        else:
            excl[n] = params_rel[n]
            excl2[n] = norm_rel(p, q)
    res["train_param_rel_max_excl_key_bias"] = max(excl.values())
    res["train_param_rel_excl_key_bias_worst"] = max(excl, key=excl.get)
    res["train_param_rel_all"] = excl
    res["train_param_rel2_max_excl_key_bias"] = max(excl2.values())
    res["train_param_rel2_excl_key_bias_worst"] = max(excl2, key=excl2.get)
    res["train_params_changed"] = max_rel(tp.embedding.wte.weight, GPT_init_wte().to(dtype)) > 1e-3
    res["train_still_tied"] = tp.head.lm_head.weight is tp.embedding.wte.weight
    res["train_grad_norm_helper_none"] = float(grad_norm(tp.parameters()))  # all grads None -> 0
    if out_dir is None:
        return

    # DCP save of the TP model, as the Engine does it (model + optimizer state)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(tp), "optim": get_optimizer_state_dict(tp, opt_tp)}
    res["dcp_model_keys_dtensor"] = all(isinstance(v, DTensor) for v in state["model"].values())
    res["dcp_model_keys"] = sorted(state["model"])
    dcp.save(state, checkpoint_id=os.path.join(out_dir, "dcp"))
    tp_full = {k: full(v).detach().clone() for k, v in tp.state_dict().items()}  # collective: every rank
    x, y = batches(1)[0]
    with torch.no_grad():
        tp_eval_loss = float(tp_loss(tp(x), y))
    if dist.get_rank() == 0:
        torch.save({"state": tp_full, "x": x, "y": y, "loss": tp_eval_loss}, os.path.join(out_dir, "tp_full_state.pt"))


class _Prefixed(dict):
    """Writes ``key`` as ``prefix + key`` into the wrapped results dict."""

    def __init__(self, target: dict, prefix: str):
        super().__init__()
        self.target, self.prefix = target, prefix

    def __setitem__(self, key, value):
        self.target[self.prefix + key] = value


def GPT_init_wte() -> torch.Tensor:
    torch.manual_seed(0)
    return GPT(SHAPE).embedding.wte.weight.detach()


def check_chunks(res: dict, mesh) -> None:
    """Pipeline chunks: [Block, Block, Head] (no Embedding) and [Embedding, Block] (no Head)."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    parts = list(model.parts)  # emb, block, block, head
    x_ids, y = batches(1)[0]

    # [Block, Block, Head]: its lm_head is the (untied inside the chunk) output projection
    ref_a = copy.deepcopy(nn.ModuleList(parts[1:]))
    tp_a = apply_tensor_parallel(copy.deepcopy(ref_a), mesh)
    h = torch.randn(B, T, SHAPE.d_model, generator=torch.Generator().manual_seed(3))
    out_ref, out = h, h
    for p in ref_a:
        out_ref = p(out_ref)
    for p in tp_a:
        out = p(out)
    res["chunkA_logits_sharded"] = isinstance(out, DTensor) and out.placements[0] in (Shard(2), Shard(-1))
    res["chunkA_logits_rel"] = max_rel(out, out_ref)
    l_ref, l_tp = lm_loss(out_ref, y), tp_loss(out, y)
    res["chunkA_loss_rel"] = scalar_rel(l_tp, l_ref)
    l_ref.backward()
    l_tp.backward()
    res["chunkA_grad_rel"] = max(max_rel(p.grad, q.grad) for p, q in zip(tp_a.parameters(), ref_a.parameters()))
    res["chunkA_lm_head_placements"] = [str(p) for p in tp_a[-1].lm_head.weight.placements]

    # [Embedding, Block]: output is the replicated hidden state
    ref_b = copy.deepcopy(nn.ModuleList(parts[:2]))
    tp_b = apply_tensor_parallel(copy.deepcopy(ref_b), mesh)
    o_ref, o = x_ids, x_ids
    for p in ref_b:
        o_ref = p(o_ref)
    for p in tp_b:
        o = p(o)
    res["chunkB_output_plain"] = type(o) is torch.Tensor
    res["chunkB_out_rel"] = max_rel(o, o_ref)
    gout = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(5))
    (o_ref * gout).sum().backward()
    (o * gout).sum().backward()
    res["chunkB_grad_rel"] = max(max_rel(p.grad, q.grad) for p, q in zip(tp_b.parameters(), ref_b.parameters()))
    res["chunkB_wte_placements"] = [str(p) for p in tp_b[0].wte.weight.placements]
    res["chunkB_wpe_placements"] = [str(p) for p in tp_b[0].wpe.weight.placements]


def check_engine_compat(res: dict, mesh) -> None:
    """The calls foldtrain.engine.ReplicatedEngine makes on its model/gradients, on a TP model."""
    torch.manual_seed(0)
    ref = GPT(SHAPE)
    tp = apply_tensor_parallel(copy.deepcopy(ref), mesh).to(device="cpu", dtype=torch.float32)  # Engine: model.to(...)
    x, y = batches(1)[0]
    lm_loss(ref(x), y).backward()
    tp_loss(tp(x), y).backward()
    # Engine.clip: get_total_norm(foreach) -> float(norm) -> clip_grads_with_norm_(foreach)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], foreach=True)
    torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), 0.5 * float(ref_norm), ref_norm, foreach=True)
    try:
        params = list(tp.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        res["engine_clip_float_norm_rel"] = scalar_rel(float(norm), ref_norm)
        torch.nn.utils.clip_grads_with_norm_(params, 0.5 * float(ref_norm), norm, foreach=True)
        res["engine_clip_grad_rel"] = max(max_rel(p.grad, q.grad) for p, q in zip(tp.parameters(), ref.parameters()))
    except Exception as e:  # noqa: BLE001
        res["engine_clip_grad_rel"] = f"error: {type(e).__name__}: {e}"
    # Precision.unscale_and_check (fp16 only): a plain bool tensor &= isfinite(DTensor grad).all()
    try:
        finite = torch.ones((), dtype=torch.bool)
        for p in tp.parameters():
            finite &= torch.isfinite(p.grad).all()
        res["engine_isfinite_mix"] = bool(finite)
    except Exception as e:  # noqa: BLE001
        res["engine_isfinite_mix"] = f"error: {type(e).__name__}: {str(e)[:200]}"
    # grads_finite: the TP-aware replacement; an inf in rank 1's shard only must be seen by both ranks
    res["grads_finite_clean"] = grads_finite([p.grad for p in tp.parameters()])
    with torch.no_grad():
        if dist.get_rank() == 1:
            tp.parts[1].mlp.fc.weight.grad.to_local()[0, 0] = float("inf")
    res["grads_finite_after_inf_on_rank1"] = grads_finite([p.grad for p in tp.parameters()])


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    res: dict = {"world_size": dist.get_world_size(), "rank": rank, "torch": torch.__version__}
    for name, fn in [
        ("forward", lambda: check_forward(res, mesh)),
        ("tp_loss_unit", lambda: check_tp_loss_unit(res, mesh)),
        ("training", lambda: check_training(res, mesh, out_dir)),
        ("training64", lambda: check_training(res, mesh, None, torch.float64, "f64_", lr=1e-2)),
        ("chunks", lambda: check_chunks(res, mesh)),
        ("engine_compat", lambda: check_engine_compat(res, mesh)),
    ]:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded and asserted by pytest
            res[f"{name}_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
