"""Fine-tuning from a Hugging Face GPT-2 (random weights) and exporting a trained run back to one:
the first step's loss is the HF model's, a pipeline layout starts from the same weights, the export
loads in transformers with the same loss, and a GPT-2-shaped tokenizer (50257 ids, <|endoftext|> =
50256) works with the gpt2-* presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")  # in the test extras

from foldtrain.cli import main  # noqa: E402
from foldtrain.config import build_config  # noqa: E402
from foldtrain.data import SequenceSampler, TokenData, load_tokenizer, prepare, val_batches  # noqa: E402
from foldtrain.model import GPT, GPTShape  # noqa: E402
from foldtrain.model.hf import load_into  # noqa: E402
from foldtrain.model.hf_config import locate  # noqa: E402
from foldtrain.train.trainer import train  # noqa: E402
from tests.conftest import tiny_run_args  # noqa: E402
from tests.parallel.pipeline.test_pipeline import torchrun  # noqa: E402

TOL = 1e-5


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def hf_loss(model, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model.eval()(x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random GPT-2 with the shape of tests.conftest.TINY_ARGS (so those explicit sizes agree with it)."""
    torch.manual_seed(7)
    cfg = transformers.GPT2Config(
        vocab_size=512,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    d = tmp_path_factory.mktemp("hf") / "gpt2-random"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    return d


def test_finetune_starts_from_the_hf_weights_in_any_layout(hf_dir, small_data, tmp_path):
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    train(build_config(tiny_run_args(small_data, one, "--train.steps", "3", "--model.init_from", str(hf_dir))))
    x, y = SequenceSampler(TokenData.open(small_data).split("train"), 32, 1337).global_batch(0, 8)
    first = losses(one)[1]
    assert abs(first - hf_loss(transformers.GPT2LMHeadModel.from_pretrained(hf_dir), x, y)) < TOL
    # a 2-rank pipeline starts from the same weights (its step-1 loss is the HF model's too)
    args = tiny_run_args(
        small_data,
        pipe,
        "--train.steps",
        "1",
        "--model.init_from",
        str(hf_dir),
        "--parallel.pp",
        "2",
        "--train.micro_batch",
        "2",
        "--train.device",
        "cpu",
    )
    r = torchrun(2, "-m", "foldtrain", "train", *args, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert abs(losses(pipe)[1] - first) < TOL
    # --resume keeps the checkpoint's weights (the init source is not read again, it may be gone)
    train(
        build_config(tiny_run_args(small_data, one, "--train.steps", "4", "--model.init_from", str(hf_dir), "--resume"))
    )
    assert sorted(losses(one)) == [1, 2, 3, 4]


def test_export_of_a_trained_run_loads_in_transformers(small_data, tmp_path):
    run, hf = tmp_path / "run", tmp_path / "hf"
    train(build_config(tiny_run_args(small_data, run, "--train.steps", "5")))
    assert main(["export", "--out", str(run), "--hf", str(hf)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in hf.iterdir()
    }
    model, info = transformers.GPT2LMHeadModel.from_pretrained(hf, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    data = TokenData.open(small_data)
    ours = GPT(GPTShape(n_layer=2, n_head=2, d_model=32, context=64, vocab_size=512))
    ours.load_state_dict({**load_file(str(run / "model.safetensors"))}, strict=False)
    ours.head.lm_head.weight = ours.embedding.wte.weight
    x, y = val_batches(data.split("val"), 32, 4, 1)[0]
    with torch.no_grad():
        assert abs(ours.eval()(x, y).item() - hf_loss(model, x, y)) < TOL
    tok, auto = load_tokenizer(data.tokenizer_path), transformers.AutoTokenizer.from_pretrained(hf)
    text = "class Foo:\n    def bar(self):\n        return {'a': 1}\n"
    assert auto(text)["input_ids"] == tok.encode(text).ids and auto.eos_token_id == data.eot_id
    # the exported directory is a valid --model.init_from, bit-exact with the run's weights
    src = locate(str(hf))
    back = GPT(GPTShape(**src.shape))
    load_into(back, src)
    saved = load_file(str(run / "model.safetensors"))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in saved.items())
    assert main(["export", "--out", str(run), "--hf", str(hf)]) == 2  # never overwrites


def gpt2_shaped_tokenizer(path: Path) -> Path:
    """Byte-level BPE laid out like GPT-2's tokenizer.json: 256 byte symbols + 50,000 merges, <|endoftext|> = 50256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) < 50256:
                merges.append((a, b))
                vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = 50256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_gpt2_tokenizer_with_a_gpt2_preset(small_corpus, tmp_path):
    tok = gpt2_shaped_tokenizer(tmp_path / "tokenizer.json")
    data = tmp_path / "data"
    meta = prepare(small_corpus, data, tokenizer_path=str(tok), val_fraction=0.1, seed=0, quiet=True)
    assert (meta["vocab_size"], meta["eot_id"]) == (50257, 50256)
    run = tmp_path / "run"
    args = [
        "--model.preset",
        "gpt2-small",
        "--model.n_layer",
        "1",
        "--model.n_head",
        "2",
        "--model.d_model",
        "32",
        "--data.path",
        str(data),
        "--train.steps",
        "2",
        "--train.global_batch",
        "4",
        "--train.seq_len",
        "32",
        "--train.eval_every",
        "0",
        "--train.eval_batches",
        "1",
        "--train.sample_tokens",
        "0",
        "--train.progress",
        "false",
        "--out",
        str(run),
    ]
    assert main(["train", *args]) == 0
    assert main(["export", "--out", str(run), "--hf", str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["n_positions"], cfg["eos_token_id"]) == (50257, 1024, 50256)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert len(auto) == 50257 and auto.convert_tokens_to_ids("<|endoftext|>") == 50256


def test_a_padded_vocabulary_takes_no_probability_and_leaves_the_process_unpadded(hf_dir, small_data, tmp_path):
    """--model.vocab_multiple pads the 512-word embedding (to 768 rows on one process, 516 under tp 2): the
    first loss is still the unpadded HF model's, the checkpoint records the padding, and the exports hold
    the true 512 words."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    pad = ("--model.init_from", str(hf_dir), "--model.vocab_multiple", "384")
    train(build_config(tiny_run_args(small_data, run, "--train.steps", "3", *pad)))
    x, y = SequenceSampler(TokenData.open(small_data).split("train"), 32, 1337).global_batch(0, 8)
    assert abs(losses(run)[1] - hf_loss(transformers.GPT2LMHeadModel.from_pretrained(hf_dir), x, y)) < TOL
    assert "vocabulary 512 padded to 768 rows" in (run / "train.log").read_text()
    assert load_file(str(run / "model.safetensors"))["parts.0.wte.weight"].shape == (512, 32)
    # a resume must pad the same way: another padding is refused with the fix, before any step
    with pytest.raises(Exception, match=r"padded_vocab 768 \(now 640\).*--model.vocab_multiple"):
        train(
            build_config(
                tiny_run_args(
                    small_data, run, "--train.steps", "4", "--resume", *pad[:2], "--model.vocab_multiple", "320"
                )
            )
        )
    train(build_config(tiny_run_args(small_data, run, "--train.steps", "4", "--resume", *pad)))
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert main(["export", "--out", str(run), "--hf", str(hf)]) == 0
    exported = transformers.GPT2LMHeadModel.from_pretrained(hf)
    assert exported.config.vocab_size == 512 and exported.transformer.wte.weight.shape == (512, 32)
    ours = GPT(GPTShape(2, 2, 32, 64, 512))
    load_into(ours, locate(str(run / "model.safetensors")))
    with torch.no_grad():
        assert abs(ours.eval()(x, y).item() - hf_loss(exported, x, y)) < TOL
    # tensor parallelism pads 512 words to a multiple of lcm(3, 2) = 6 rows and starts from the HF weights
    tp = tmp_path / "tp"
    args = tiny_run_args(
        small_data, tp, "--train.steps", "1", *pad[:2], "--model.vocab_multiple", "3", "--parallel.tp", "2"
    )
    r = torchrun(2, "-m", "foldtrain", "train", *args, "--train.device", "cpu", timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert abs(losses(tp)[1] - losses(run)[1]) < TOL
    assert "vocabulary 512 padded to 516 rows" in (tp / "train.log").read_text()
