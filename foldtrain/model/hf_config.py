"""Where ``--model.init_from`` points, and the model shape it implies (plain Python, no torch).

Two kinds of source are accepted:

- a Hugging Face GPT-2 directory: ``config.json`` and the weights as ``model.safetensors``,
  ``model.safetensors.index.json`` (sharded) or ``pytorch_model.bin``;
- a foldtrain ``model.safetensors`` (its header carries the shape as ``foldtrain_shape``
  metadata), or a foldtrain run directory holding one.

The shape is read from ``config.json`` or from the safetensors header (8-byte length + JSON),
so resolving the config costs no tensor loading and imports no torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foldtrain.errors import ConfigError

SHAPE_KEYS = ("n_layer", "n_head", "d_model", "context", "vocab_size")
# activations that are GPT-2's tanh-approximated GELU, which foldtrain's MLP computes
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class InitSource:
    kind: str  # "hf" or "foldtrain"
    path: Path  # HF: the directory; foldtrain: the .safetensors file
    shape: dict[str, int]
    weights: Path | None = None  # HF: the weight file (safetensors, index or .bin)
    tokenizer: Path | None = None  # a tokenizer.json beside the weights, if any


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` table of a safetensors file's header (no tensor is read)."""
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{path} is not a readable safetensors file ({e}); "
            "pass a model.safetensors written by foldtrain or Hugging Face"
        ) from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def shape_from_hf_config(hf: dict[str, Any], where: Path) -> dict[str, int]:
    """foldtrain's shape from a GPT-2 ``config.json``; refuses what foldtrain's GPT does not compute."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}; --model.init_from takes GPT-2 checkpoints (GPT2LMHeadModel)")

    mt = hf.get("model_type")
    if mt != "gpt2":
        raise bad(f"model_type is {mt!r}, not 'gpt2'")
    try:
        shape = {
            "n_layer": int(hf["n_layer"]),
            "n_head": int(hf["n_head"]),
            "d_model": int(hf["n_embd"]),
            "context": int(hf.get("n_positions", hf.get("n_ctx"))),
            "vocab_size": int(hf["vocab_size"]),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"the config lacks or garbles {e}") from None
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise bad(f"activation_function {act!r} is not GPT-2's tanh GELU ({', '.join(TANH_GELUS)})")
    n_inner = hf.get("n_inner")
    if n_inner not in (None, 4 * shape["d_model"]):
        raise bad(f"n_inner {n_inner} is not 4 x n_embd ({4 * shape['d_model']})")
    eps = float(hf.get("layer_norm_epsilon", 1e-5))
    if abs(eps - 1e-5) > 1e-12:
        raise bad(f"layer_norm_epsilon {eps} is not 1e-05")
    for flag, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ):
        if bool(hf.get(flag, want)) != want:
            raise bad(f"{flag} is {hf.get(flag)!r}, foldtrain's GPT needs {want}")
    return shape


def _hf_weights(d: Path) -> Path:
    for name in HF_WEIGHT_FILES:
        if (d / name).is_file():
            return d / name
    raise ConfigError(
        f"--model.init_from {d} has config.json but no weights ({', '.join(HF_WEIGHT_FILES)}); "
        "download the model's weight file into it"
    )


def _foldtrain_shape(f: Path) -> dict[str, int]:
    meta = safetensors_metadata(f)
    if "foldtrain_shape" not in meta:
        raise ConfigError(
            f"--model.init_from {f} has no foldtrain shape metadata; "
            "pass a model.safetensors written by `foldtrain train`, "
            "or a Hugging Face directory with config.json beside the weights"
        )
    try:
        raw = json.loads(meta["foldtrain_shape"])
        return {k: int(raw[k]) for k in SHAPE_KEYS}
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--model.init_from {f}: its foldtrain_shape metadata lacks or garbles {e}; re-export the model"
        ) from None


def locate(path: str) -> InitSource:
    """What ``--model.init_from PATH`` names, with its model shape; one-line errors otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"--model.init_from {p} does not exist; pass a Hugging Face GPT-2 directory (config.json + weights) "
            "or a foldtrain model.safetensors"
        )
    if p.is_dir() and (p / "config.json").is_file():
        try:
            hf = json.loads((p / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{p / 'config.json'} is not valid JSON ({e}); re-download it") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{p / 'config.json'} is not a JSON object; re-download it")
        tok = p / "tokenizer.json"
        return InitSource(
            "hf", p, shape_from_hf_config(hf, p / "config.json"), _hf_weights(p), tok if tok.is_file() else None
        )
    if p.is_dir():
        if not (p / "model.safetensors").is_file():
            raise ConfigError(
                f"--model.init_from {p} holds neither config.json (a Hugging Face model) nor model.safetensors "
                "(a foldtrain run); "
                "pass one of those"
            )
        p = p / "model.safetensors"
    return InitSource("foldtrain", p, _foldtrain_shape(p))


def resolve_init_from(model_cfg: Any, presets: dict[str, dict[str, int]], default_preset: str) -> InitSource | None:
    """Fill the model shape from ``model_cfg.init_from``; an explicit conflicting value is an error.

    Fields left at 0 were not given and are taken from the checkpoint; a preset other than the
    default must agree with it. When the shape matches a preset, that preset's name is recorded.
    """
    if not model_cfg.init_from:
        return None
    if not Path(model_cfg.init_from).expanduser().exists() and all(getattr(model_cfg, k) for k in SHAPE_KEYS):
        # a saved run's config (every size written out) whose source is gone: resume, eval and generate need none
        return None
    src = locate(model_cfg.init_from)
    shape = src.shape
    for k in SHAPE_KEYS:
        given = getattr(model_cfg, k)
        if given and given != shape[k]:
            raise ConfigError(
                f"--model.{k} {given} conflicts with --model.init_from {model_cfg.init_from} ({k} {shape[k]}); "
                f"drop --model.{k}"
            )
    preset = model_cfg.preset
    if preset != default_preset and preset in presets and presets[preset] != shape:
        diff = ", ".join(
            f"{k} {presets[preset][k]} vs {shape[k]}" for k in SHAPE_KEYS if presets[preset][k] != shape[k]
        )
        raise ConfigError(
            f"--model.preset {preset} conflicts with --model.init_from {model_cfg.init_from} ({diff}); "
            "drop --model.preset"
        )
    for k in SHAPE_KEYS:
        setattr(model_cfg, k, shape[k])
    if preset in presets:
        model_cfg.preset = next((name for name, s in presets.items() if s == shape), preset)
    return src
