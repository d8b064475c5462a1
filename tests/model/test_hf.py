"""Hugging Face GPT-2 <-> foldtrain GPT with random weights (never a download): logits, exact
round trip, the hub's checkpoint variants, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")  # in the test extras

from foldtrain.config import build_config  # noqa: E402
from foldtrain.errors import ConfigError  # noqa: E402
from foldtrain.model import GPT, GPTShape  # noqa: E402
from foldtrain.model.hf import export_hf, foldtrain_to_hf, hf_to_foldtrain, load_into  # noqa: E402
from foldtrain.model.hf_config import locate  # noqa: E402

SHAPE = dict(n_layer=2, n_head=4, d_model=48, context=64, vocab_size=300)
TOL = 1e-5


def hf_gpt2(seed: int = 0, **kw) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=SHAPE["vocab_size"],
        n_positions=SHAPE["context"],
        n_embd=SHAPE["d_model"],
        n_layer=SHAPE["n_layer"],
        n_head=SHAPE["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants; randomise them so the layout is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "gpt2-random"
    hf_gpt2().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tokenizer_json(small_corpus, tmp_path_factory) -> Path:
    from foldtrain.data import train_tokenizer

    docs = [p.read_text(errors="replace") for p in sorted(small_corpus.iterdir())[:10]]
    f = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(docs, SHAPE["vocab_size"]).save(str(f))
    return f


def foldtrain_from(path: Path) -> GPT:
    src = locate(str(path))
    model = GPT(GPTShape(**src.shape)).eval()
    with torch.no_grad():
        load_into(model, src)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(seed))


def test_hf_to_foldtrain_logits(hf_dir):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = foldtrain_from(hf_dir)
    x = tokens()
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max().item() < TOL


def test_foldtrain_to_hf_logits_and_tokenizer(tmp_path, tokenizer_json):
    from foldtrain.data import load_tokenizer

    torch.manual_seed(3)
    ours = GPT(GPTShape(**SHAPE)).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias") or ".ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    tok = load_tokenizer(tokenizer_json)
    out = export_hf(ours.state_dict(), SHAPE, tmp_path / "hf", tokenizer_json, tok.token_to_id("<|endoftext|>"))
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    x = tokens(2)
    with torch.no_grad():
        assert (hf.eval()(x).logits - ours(x)).abs().max().item() < TOL
    auto = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x ** 2  # héllo\n"
    assert auto(text)["input_ids"] == tok.encode(text).ids and auto.decode(auto(text)["input_ids"]) == text
    assert (
        auto.eos_token == "<|endoftext|>"
        and auto.eos_token_id == tok.token_to_id("<|endoftext|>") == hf.config.eos_token_id
    )


def test_round_trip_is_bit_exact(hf_dir, tmp_path, tokenizer_json):
    ours = foldtrain_from(hf_dir)
    out = export_hf(ours.state_dict(), SHAPE, tmp_path / "back", tokenizer_json, 0)
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    a = {k if k.startswith("transformer.") else "transformer." + k: v for k, v in a.items() if k != "lm_head.weight"}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the functions alone, both ways, on a state dict
    sd = hf_gpt2(seed=5).state_dict()
    back = foldtrain_to_hf(hf_to_foldtrain(sd, SHAPE), SHAPE)
    assert all(torch.equal(back[k], sd[k]) for k in back) and set(sd) - set(back) == {"lm_head.weight"}


def test_hub_variants_load(hf_dir, tmp_path):
    """No `transformer.` prefix, old attn.bias / attn.masked_bias buffers, lm_head present, pytorch_model.bin."""
    sd = {k.removeprefix("transformer."): v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    n = SHAPE["context"]
    for i in range(SHAPE["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    sd["lm_head.weight"] = sd["wte.weight"].clone()
    d = tmp_path / "old"
    d.mkdir()
    (d / "config.json").write_text((hf_dir / "config.json").read_text())
    torch.save(sd, d / "pytorch_model.bin")
    ref, old = foldtrain_from(hf_dir), foldtrain_from(d)
    assert all(torch.equal(p, q) for p, q in zip(ref.state_dict().values(), old.state_dict().values()))


def test_init_from_resolves_the_shape(hf_dir, tmp_path, tokenizer_json):
    with pytest.raises(
        ConfigError,
        match="has no tokenizer.json, and a BPE trained on your data would give ids the weights do not know",
    ):
        init_cfg([str(hf_dir)])  # raw (or default) data to be tokenized, and no tokenizer for it
    cfg = init_cfg([str(hf_dir), "--data.tokenizer", str(tokenizer_json)])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context, cfg.model.vocab_size) == (
        2,
        4,
        48,
        64,
        300,
    )
    assert cfg.data.tokenizer == str(tokenizer_json)  # an explicit tokenizer wins
    # a foldtrain model.safetensors (shape in its metadata), and a HF directory with a tokenizer
    from foldtrain.checkpoint import export_safetensors

    f = export_safetensors(foldtrain_from(hf_dir), tmp_path / "model.safetensors", SHAPE)
    assert init_cfg([str(f)]).model.d_model == 48
    assert all(
        torch.equal(p, q)
        for p, q in zip(foldtrain_from(f).state_dict().values(), foldtrain_from(hf_dir).state_dict().values())
    )
    hub = export_hf(foldtrain_from(hf_dir).state_dict(), SHAPE, tmp_path / "with_tok", tokenizer_json, 0)
    assert init_cfg([str(hub)]).data.tokenizer == str(hub / "tokenizer.json")
    small = dict(n_layer=12, n_head=12, d_model=768, context=1024, vocab_size=50257)
    g = tmp_path / "gpt2.json"
    g.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257}
        )
    )
    from foldtrain.model.hf_config import shape_from_hf_config

    assert shape_from_hf_config(json.loads(g.read_text()), g) == small


def init_cfg(args: list[str]):
    return build_config(["--model.init_from", *args, "--train.seq_len", "32"])


def _write(d: Path, config: dict | None, weights: dict | None = None, bin_obj=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    if bin_obj is not None:
        torch.save(bin_obj, d / "pytorch_model.bin")
    return d


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_bad_inputs(hf_dir, tmp_path, tokenizer_json, capsys):
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    cases = {
        "does not exist": str(tmp_path / "nowhere"),
        "holds neither config.json": str(_write(tmp_path / "empty", None)),
        "has config.json but no weights": str(_write(tmp_path / "noweights", config)),
        "model_type is 'llama'": str(_write(tmp_path / "llama", {**config, "model_type": "llama"}, weights)),
        "activation_function 'relu'": str(
            _write(tmp_path / "relu", {**config, "activation_function": "relu"}, weights)
        ),
        "has no foldtrain shape metadata": str(tmp_path / "plain.safetensors"),
    }
    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    for needle, path in cases.items():
        with pytest.raises(ConfigError, match=needle):
            init_cfg([path])
    tok = ["--data.tokenizer", str(tokenizer_json)]
    for k, v in {"--model.n_layer": "3", "--model.d_model": "64", "--model.vocab_size": "8192"}.items():
        with pytest.raises(ConfigError, match=f"{k} {v} conflicts with --model.init_from"):
            init_cfg([str(hf_dir), k, v, *tok])
    with pytest.raises(
        ConfigError, match="--model.preset gpt2-small conflicts with --model.init_from .*n_layer 12 vs 2"
    ):
        init_cfg([str(hf_dir), "--model.preset", "gpt2-small", *tok])
    assert init_cfg([str(hf_dir), "--model.n_layer", "2", *tok]).model.n_layer == 2  # agreeing is fine
    # weights that do not match the config, and a pickle that would run code: refused when loaded
    short = {k: v for k, v in weights.items() if ".h.1." not in k}
    with pytest.raises(ConfigError, match="lacks transformer.h.1|lacks h.1"):
        foldtrain_from(_write(tmp_path / "short", config, short))
    with pytest.raises(ConfigError, match="cannot read weights .*pytorch_model.bin"):
        foldtrain_from(_write(tmp_path / "evil", config, bin_obj={"wte.weight": Evil()}))
    assert "this must never run" not in capsys.readouterr().out
    untied = {**weights, "lm_head.weight": torch.randn_like(weights["transformer.wte.weight"])}
    with pytest.raises(ConfigError, match="untied head"):
        foldtrain_from(_write(tmp_path / "untied", config, untied))
