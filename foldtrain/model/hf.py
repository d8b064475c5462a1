"""Hugging Face GPT-2 weights in and out of foldtrain's GPT (torch + safetensors + json; no transformers).

foldtrain's GPT computes GPT-2's function; only the layout differs:

- HF's ``Conv1D`` stores a weight as (in, out), ``nn.Linear`` as (out, in): transposed;
- HF packs ``c_attn``'s output features as [q | k | v] (each head-major inside), foldtrain's
  ``qkv`` is head-major ([head][q|k|v][head_dim]) so a column-parallel split keeps whole heads;
- HF names live under ``transformer.`` with ``lm_head.weight`` tied to ``wte``; hub checkpoints
  may lack the prefix and ``lm_head.weight``, and old ones carry the ``attn.bias`` /
  ``attn.masked_bias`` mask buffers, which are dropped.

Both directions are permutations, so HF -> foldtrain -> HF is bit-exact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from foldtrain.errors import ConfigError
from foldtrain.model.hf_config import SHAPE_KEYS, InitSource, locate
from foldtrain.model.vocab import pad_rows, strip_padding

_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
EOT = "<|endoftext|>"

# (HF name without "transformer.", foldtrain name, kind); {i} is the block, {p} its part index, {h} the head
_BLOCK = (
    ("h.{i}.ln_1.weight", "parts.{p}.ln1.weight", "copy"),
    ("h.{i}.ln_1.bias", "parts.{p}.ln1.bias", "copy"),
    ("h.{i}.attn.c_attn.weight", "parts.{p}.attn.qkv.weight", "qkv"),
    ("h.{i}.attn.c_attn.bias", "parts.{p}.attn.qkv.bias", "qkv"),
    ("h.{i}.attn.c_proj.weight", "parts.{p}.attn.proj.weight", "conv1d"),
    ("h.{i}.attn.c_proj.bias", "parts.{p}.attn.proj.bias", "copy"),
    ("h.{i}.ln_2.weight", "parts.{p}.ln2.weight", "copy"),
    ("h.{i}.ln_2.bias", "parts.{p}.ln2.bias", "copy"),
    ("h.{i}.mlp.c_fc.weight", "parts.{p}.mlp.fc.weight", "conv1d"),
    ("h.{i}.mlp.c_fc.bias", "parts.{p}.mlp.fc.bias", "copy"),
    ("h.{i}.mlp.c_proj.weight", "parts.{p}.mlp.proj.weight", "conv1d"),
    ("h.{i}.mlp.c_proj.bias", "parts.{p}.mlp.proj.bias", "copy"),
)


def name_map(n_layer: int) -> list[tuple[str, str, str]]:
    """Every (HF name, foldtrain name, kind) of a GPT-2 of ``n_layer`` blocks; the tied head excluded."""
    rows = [("wte.weight", "parts.0.wte.weight", "copy"), ("wpe.weight", "parts.0.wpe.weight", "copy")]
    for i in range(n_layer):
        rows += [(h.format(i=i), f.format(p=i + 1), k) for h, f, k in _BLOCK]
    last = n_layer + 1
    rows += [("ln_f.weight", f"parts.{last}.ln_f.weight", "copy"), ("ln_f.bias", f"parts.{last}.ln_f.bias", "copy")]
    return rows


def _hf_shape(kind: str, ft_shape: torch.Size) -> tuple[int, ...]:
    return tuple(reversed(ft_shape)) if kind == "conv1d" or (kind == "qkv" and len(ft_shape) == 2) else tuple(ft_shape)


def _qkv_to_foldtrain(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF c_attn (weight (d, 3d) or bias (3d,)) -> foldtrain qkv (weight (3d, d) or bias (3d,))."""
    t = t.t() if t.dim() == 2 else t
    rest = t.shape[1:]
    hd = t.shape[0] // (3 * n_head)
    return t.reshape(3, n_head, hd, *rest).transpose(0, 1).reshape(3 * n_head * hd, *rest).contiguous()


def _qkv_to_hf(t: torch.Tensor, n_head: int) -> torch.Tensor:
    rest = t.shape[1:]
    hd = t.shape[0] // (3 * n_head)
    t = t.reshape(n_head, 3, hd, *rest).transpose(0, 1).reshape(3 * n_head * hd, *rest)
    return (t.t() if t.dim() == 2 else t).contiguous()


def normalize_hf_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip ``transformer.``, drop mask buffers, check and drop a tied ``lm_head.weight``."""
    out: dict[str, torch.Tensor] = {}
    head = None
    for k, v in sd.items():
        if k == "lm_head.weight":
            head = v
            continue
        k = k.removeprefix("transformer.")
        if _BUFFER.match(k):
            continue
        out[k] = v
    if head is not None and "wte.weight" in out and not torch.equal(head, out["wte.weight"]):
        raise ConfigError(
            "the checkpoint's lm_head.weight differs from transformer.wte.weight (untied head); "
            "foldtrain's GPT ties them and cannot load it"
        )
    return out


def hf_to_foldtrain(
    sd: dict[str, torch.Tensor], shape: dict[str, int], where: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict (HF names, any of the hub's variants) as foldtrain ``GPT.state_dict()`` keys."""
    sd = normalize_hf_keys(sd)
    rows = name_map(shape["n_layer"])
    expected = {h for h, _, _ in rows}
    missing = [h for h, _, _ in rows if h not in sd]
    unexpected = sorted(set(sd) - expected)
    if missing or unexpected:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"has unexpected tensors {', '.join(unexpected[:3])}"
        raise ConfigError(
            f"{where} {what}{' ...' if len(missing or unexpected) > 3 else ''}; "
            f"it does not match its config.json (a GPT-2 of {shape['n_layer']} layers)"
        )
    d, v = shape["d_model"], shape["vocab_size"]
    out: dict[str, torch.Tensor] = {}
    for h, f, kind in rows:
        t = sd[h]
        if kind == "qkv":
            want = (d, 3 * d) if t.dim() == 2 else (3 * d,)
        elif h == "wte.weight":
            want = (v, d)
        elif h == "wpe.weight":
            want = (shape["context"], d)
        else:
            want = None
        if want is not None and tuple(t.shape) != want:
            raise ConfigError(
                f"{where}: {h} has shape {tuple(t.shape)}, expected {want} from config.json; "
                "the weights and config.json disagree"
            )
        if kind == "qkv":
            out[f] = _qkv_to_foldtrain(t, shape["n_head"])
        elif kind == "conv1d":
            out[f] = t.t().contiguous()
        else:
            out[f] = t
    out[f"parts.{shape['n_layer'] + 1}.lm_head.weight"] = out["parts.0.wte.weight"]
    return out


def foldtrain_to_hf(sd: dict[str, torch.Tensor], shape: dict[str, int]) -> dict[str, torch.Tensor]:
    """foldtrain ``GPT.state_dict()`` as ``GPT2LMHeadModel`` keys (``lm_head.weight`` left to the tie), with
    the true vocabulary of ``shape`` (a padded model's padding rows are left out)."""
    sd = strip_padding(sd, shape["vocab_size"])
    out: dict[str, torch.Tensor] = {}
    for h, f, kind in name_map(shape["n_layer"]):
        t = sd[f].detach()
        if kind == "qkv":
            t = _qkv_to_hf(t, shape["n_head"])
        elif kind == "conv1d":
            t = t.t()
        out["transformer." + h] = t.contiguous().clone()
    return out


def load_hf_state(weights: Path) -> dict[str, torch.Tensor]:
    """Tensors of a HF weight file: safetensors, a sharded safetensors index, or a pytorch_model.bin.

    A ``.bin`` is read with ``torch.load(weights_only=True)``: tensors only, no pickled code runs.
    """
    from safetensors.torch import load_file

    try:
        if weights.name.endswith(".index.json"):
            index = json.loads(weights.read_text(encoding="utf-8"))
            out: dict[str, torch.Tensor] = {}
            for shard in sorted(set(index["weight_map"].values())):
                out.update(load_file(str(weights.parent / shard)))
            return out
        if weights.suffix == ".safetensors":
            return load_file(str(weights))
        sd = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (safetensors, json and the unpickler raise assorted types)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"cannot read weights {weights} ({type(e).__name__}: {msg[:200]}); re-download the file"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(
            f"{weights} does not hold a flat dict of tensors; pass a GPT-2 pytorch_model.bin or model.safetensors"
        )
    return sd


def load_into(model: nn.Module, src: InitSource) -> None:
    """Copy the weights of ``src`` into ``model`` (a foldtrain GPT of ``src.shape``, its vocabulary maybe
    padded: the padding rows start at zero)."""
    rows = model.shape.embedding_rows
    if src.kind == "hf":
        sd = hf_to_foldtrain(load_hf_state(src.weights), src.shape, str(src.weights))
        model.load_state_dict(pad_rows(sd, rows), strict=True)
        return
    try:
        load_safetensors(model, src.path)
    except (RuntimeError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"cannot load {src.path} into the model ({first}); pass a model.safetensors written by foldtrain"
        ) from None


def load_safetensors(model: nn.Module, path: Path) -> None:
    """Load a foldtrain ``model.safetensors`` (true vocabulary, tied weights stored once) into ``model``."""
    from safetensors.torch import load_file

    sd = load_file(str(path))
    names = dict(model.named_parameters(remove_duplicate=False))
    for name in model.state_dict():
        if name not in sd:  # a tied name stored under its twin's
            twin = next((n for n, p in names.items() if p is names.get(name) and n in sd), None)
            if twin is not None:
                sd[name] = sd[twin]
    model.load_state_dict(pad_rows(sd, model.shape.embedding_rows), strict=True)


def maybe_init_from(cfg: Any, model: nn.Module) -> nn.Module:
    """``--model.init_from``: load those weights into the freshly built ``model``; a resumed run keeps its
    checkpoint's."""
    path = cfg.model.init_from
    if not path or cfg.resume:
        return model
    src = locate(path)
    have = {k: getattr(model.shape, k) for k in SHAPE_KEYS}
    if have != src.shape:
        raise ConfigError(
            f"--model.init_from {path} has shape {src.shape} but the model was built as {have}; "
            "leave the --model.* sizes to the checkpoint"
        )
    with torch.no_grad():
        load_into(model, src)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"model: initial weights from {src.weights or src.path} "
            f"({'Hugging Face GPT-2' if src.kind == 'hf' else 'foldtrain'})",
            file=sys.stderr,
            flush=True,
        )
    return model


# ---------------------------------------------------------------- export


def hf_config(shape: dict[str, int], eot_id: int, dropout: float = 0.0) -> dict[str, Any]:
    """A ``config.json`` for ``GPT2LMHeadModel`` of this shape (tanh GELU as PyTorch computes it)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": shape["vocab_size"],
        "n_positions": shape["context"],
        "n_ctx": shape["context"],
        "n_embd": shape["d_model"],
        "n_layer": shape["n_layer"],
        "n_head": shape["n_head"],
        "n_inner": None,
        "activation_function": "gelu_pytorch_tanh",
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "summary_first_dropout": dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
    }


def _write_tokenizer(tokenizer_json: Path, out: Path, context: int) -> None:
    """tokenizer.json as is, plus what ``AutoTokenizer`` and the slow GPT-2 tokenizer read."""
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    added = {
        str(a["id"]): {
            "content": a["content"],
            "lstrip": a.get("lstrip", False),
            "normalized": a.get("normalized", False),
            "rstrip": a.get("rstrip", False),
            "single_word": a.get("single_word", False),
            "special": a.get("special", True),
        }
        for a in tok.get("added_tokens", [])
    }
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": context,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    model = tok.get("model", {})
    if model.get("type") == "BPE" and isinstance(model.get("vocab"), dict):  # the files the slow tokenizer reads
        vocab = dict(model["vocab"])
        for a in tok.get("added_tokens", []):
            vocab.setdefault(a["content"], a["id"])
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        (out / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8")


def export_hf(
    state: dict[str, torch.Tensor],
    shape: dict[str, int],
    out_dir: str | Path,
    tokenizer_json: str | Path,
    eot_id: int,
    dropout: float = 0.0,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files of a Hugging Face GPT-2 directory."""
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.float() if v.dtype != torch.float32 else v for k, v in foldtrain_to_hf(state, shape).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(shape, eot_id, dropout), indent=2) + "\n")
    _write_tokenizer(Path(tokenizer_json), out, shape["context"])
    return out
