"""Export model weights to ``safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn
from safetensors.torch import save_file

from foldtrain import faults
from foldtrain.model.hf import load_safetensors
from foldtrain.model.vocab import strip_padding


def export_safetensors(model: nn.Module, path: str | Path, shape: dict | None = None) -> Path:
    """Write the model's weights (tied weights stored once, the true vocabulary: a padded model's padding
    rows are left out) with the model shape as metadata."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    seen: set[int] = set()
    state = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue  # the tied twin of a tensor already stored
        seen.add(t.data_ptr())
        state[name] = t.detach()
    if shape and shape.get("padded_vocab"):
        state = strip_padding(state, shape["vocab_size"])
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, str(tmp), metadata={"foldtrain_shape": json.dumps(shape or {})})
    faults.point("export")
    tmp.replace(path)
    return path


def import_safetensors(model: nn.Module, path: str | Path) -> None:
    load_safetensors(model, Path(path))
