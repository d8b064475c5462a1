"""The end of a pipelined run: the other ranks leave while rank 0 still assembles, exports and
samples the full model (seconds of work), and the run ends cleanly every time — exit 0 and a
model.safetensors holding the final checkpoint's weights. Two launches, since the failure this guards
against (a rank aborting in teardown while the full state dict is pickled to rank 0) is intermittent."""

from __future__ import annotations

import pytest
import torch

from foldtrain.checkpoint.export import import_safetensors
from foldtrain.checkpoint.manager import load_model_weights
from foldtrain.model import GPT, GPTShape
from tests.conftest import tiny_run_args
from tests.support import failed, torchrun

SHAPE = dict(n_layer=4, n_head=8, d_model=512, context=64, vocab_size=512)


@pytest.mark.parametrize("attempt", [1, 2])
def test_pipelined_run_ends_cleanly(small_data, tmp_path, attempt):
    out = tmp_path / "run"
    args = tiny_run_args(
        small_data,
        out,
        "--model.n_layer",
        "4",
        "--model.n_head",
        "8",
        "--model.d_model",
        "512",
        "--train.steps",
        "2",
        "--train.global_batch",
        "4",
        "--parallel.pp",
        "2",
        "--parallel.schedule",
        "1f1b",
        "--train.sample_tokens",
        "48",
        "--checkpoint.every",
        "0",
    )
    r = torchrun(2, "-m", "foldtrain", "train", *args, timeout=600)
    assert r.returncode == 0, failed(r)
    assert "----- sample after 2 steps -----" in r.stdout
    exported, final = GPT(GPTShape(**SHAPE)), GPT(GPTShape(**SHAPE), seed=99)
    import_safetensors(exported, out / "model.safetensors")
    load_model_weights(final, max(p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")))
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), final.state_dict().values()))
