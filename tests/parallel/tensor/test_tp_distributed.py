"""Tensor parallelism over 2 gloo ranks on CPU vs the single-process model: ONE torchrun launch.

``tp_worker.py`` runs every check and writes ``result_rank{r}.json``; the tests below assert on it.
The DCP checkpoint the worker saved under TP=2 is loaded here, in this single process (no process
group), into a plain GPT.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from tests.support import failed, torchrun

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TOL = 1e-5
# fp32 parameters after five AdamW steps: every tensor within TOL in the 2-norm, the measure of the dp and
# pipeline equivalence tests (measured 5.9e-6 at worst); single elements within ELEM_TOL of their tensor's
# largest entry, since Adam turns a nearly cancelling gradient element's summation-order rounding into an
# update of arbitrary sign (an AMD EPYC put one ln1.bias element at 2.1e-5). The float64 run checks every
# element of every parameter at TOL.
ELEM_TOL = 1e-4


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("tp2")
    proc = torchrun(2, str(HERE / "tp_worker.py"), str(out), timeout=180)
    assert proc.returncode == 0, failed(proc)
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]
    return results, out


@pytest.fixture(scope="module")
def results(tp_run) -> list[dict]:
    return tp_run[0]


def test_worker_ran_without_errors(results):
    for r in results:
        errors = {k: v for k, v in r.items() if k.endswith("_error")}
        assert not errors, errors
        assert r["world_size"] == 2


def test_forward_matches_single_process(results):
    for r in results:
        assert r["forward_logits_rel"] < TOL
        assert r["forward_loss_rel"] < TOL
        # logits stay sharded over the vocabulary: a DTensor Shard(-1), half the vocab locally
        assert r["logits_is_dtensor"] is True
        assert r["logits_placements"] in (["S(2)"], ["S(-1)"])
        assert r["logits_local_vocab"] == 32


def test_layout_and_tied_weights(results):
    r = results[0]
    assert r["tied_after_tp"] is True and r["deepcopy_tied"] is True and r["train_still_tied"] is True
    assert r["tied_placements"] == ["S(0)"]
    assert r["n_params_tp"] == r["n_params_ref"] and r["numel_full_equal"] is True
    assert r["all_params_dtensor"] is True
    pl = r["placements"]
    assert pl["parts.0.wte.weight"] == ["S(0)"] and pl["parts.0.wpe.weight"] == ["R"]
    for i in (1, 2):
        b = f"parts.{i}."
        assert pl[b + "attn.qkv.weight"] == ["S(0)"] and pl[b + "attn.qkv.bias"] == ["S(0)"]
        assert pl[b + "mlp.fc.weight"] == ["S(0)"] and pl[b + "mlp.fc.bias"] == ["S(0)"]
        assert pl[b + "attn.proj.weight"] == ["S(1)"] and pl[b + "attn.proj.bias"] == ["R"]
        assert pl[b + "mlp.proj.weight"] == ["S(1)"] and pl[b + "mlp.proj.bias"] == ["R"]
        for ln in ("ln1", "ln2"):
            assert pl[b + ln + ".weight"] == ["R"] and pl[b + ln + ".bias"] == ["R"]
    assert pl["parts.3.ln_f.weight"] == ["R"]
    assert "parts.3.lm_head.weight" not in pl  # the tied weight is listed once, as wte
    assert r["deepcopy_forward_rel"] < TOL


def test_tp_loss_value_and_gradient(results):
    for r in results:
        assert r["tp_loss_unit_loss_rel"] < TOL
        assert r["tp_loss_unit_grad_rel"] < TOL
        assert r["tp_loss_unit_plain_rel"] == 0.0


def test_replicated_gradients_identical_across_ranks(results):
    for r in results:
        assert r["replicated_grads_identical_across_ranks"] is True
        assert r["grad_placements_match_params"] is True
        assert any(n.endswith("ln1.weight") for n in r["replicated_param_names"])
        assert any(n.endswith("mlp.proj.bias") for n in r["replicated_param_names"])
        assert r["step0_grad_rel_max"] < TOL
        assert r["f64_step0_grad_rel_max"] < 1e-12


@pytest.mark.parametrize("prefix", ["", "f64_"])
def test_five_adamw_steps_match_single_process(results, prefix):
    for r in results:
        assert len(r[prefix + "train_loss_rel"]) == 5
        assert max(r[prefix + "train_loss_rel"]) < TOL
        assert max(r[prefix + "train_norm_rel"]) < TOL
        assert r[prefix + "grad_norm_is_plain"] is True
        assert r[prefix + "train_params_changed"] is True
        # clipping at 1.0 really scaled the gradients (the norms are above 1)
        assert max(r[prefix + "train_grad_norms"]) > 1.0
        # every parameter (full_tensor) against the single-process run; in fp32 the key biases, whose exact
        # gradient is zero, hold Adam-amplified rounding noise and are left out (see worker)
        assert r[prefix + "train_param_rel2_max_excl_key_bias"] < TOL, r[
            prefix + "train_param_rel2_excl_key_bias_worst"
        ]
        assert r[prefix + "train_param_rel_max_excl_key_bias"] < (ELEM_TOL if not prefix else TOL), r[
            prefix + "train_param_rel_excl_key_bias_worst"
        ]
    assert results[0]["f64_train_param_rel_max"] < TOL  # float64: all entries, key biases included


def test_clipping_and_torch_total_norm(results):
    for r in results:
        assert r["small_clip_grad_rel"] < TOL  # a clip that scales gives the same gradients
        assert r["restore_grad_rel"] < TOL
        # torch.nn.utils.get_total_norm on DTensor grads also gives the global norm (as a DTensor)
        assert r["torch_total_norm_type"] == "DTensor"
        assert max(r["torch_get_total_norm_rel"]) < TOL
        assert r["train_grad_norm_helper_none"] == 0.0


def test_engine_calls_on_tp_model(results):
    for r in results:
        # Engine.clip (get_total_norm + float + clip_grads_with_norm_, foreach) works on DTensor grads
        assert r["engine_clip_float_norm_rel"] < TOL
        assert r["engine_clip_grad_rel"] < TOL
        # the overflow check needs grads_finite (a plain flag &= isfinite(DTensor) fails), agreed over ranks
        assert r["grads_finite_clean"] is True
        assert r["grads_finite_after_inf_on_rank1"] is False


def test_pipeline_chunks(results):
    for r in results:
        # [Block, Block, Head]
        assert r["chunkA_logits_sharded"] is True
        assert r["chunkA_logits_rel"] < TOL and r["chunkA_loss_rel"] < TOL and r["chunkA_grad_rel"] < TOL
        assert r["chunkA_lm_head_placements"] == ["S(0)"]
        # [Embedding, Block]
        assert r["chunkB_output_plain"] is True
        assert r["chunkB_out_rel"] < TOL and r["chunkB_grad_rel"] < TOL
        assert r["chunkB_wte_placements"] == ["S(0)"] and r["chunkB_wpe_placements"] == ["R"]


def test_dcp_tp2_checkpoint_loads_into_single_process_model(tp_run):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from foldtrain.model.gpt import GPT, GPTShape, lm_loss

    results, out = tp_run
    assert results[0]["dcp_model_keys_dtensor"] is True
    expected = torch.load(out / "tp_full_state.pt", weights_only=True)
    model = GPT(
        GPTShape(n_layer=2, n_head=4, d_model=32, context=16, vocab_size=64, dropout=0.0), seed=123
    )  # other weights: all must come from the checkpoint
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(out / "dcp"), no_dist=True)
    set_model_state_dict(model, state["model"])
    got = model.state_dict()
    assert sorted(got) == sorted(expected["state"])
    for k, v in expected["state"].items():
        assert torch.equal(got[k], v), k
    assert model.head.lm_head.weight is model.embedding.wte.weight
    with torch.no_grad():
        loss = float(lm_loss(model(expected["x"]), expected["y"]))
    assert abs(loss - expected["loss"]) <= TOL * abs(expected["loss"])
