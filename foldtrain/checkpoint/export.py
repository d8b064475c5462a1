"""Export model weights to ``safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn
from safetensors.torch import load_model, save_model

from foldtrain import faults


def export_safetensors(model: nn.Module, path: str | Path, shape: dict | None = None) -> Path:
    """Write the model's weights (tied weights stored once) with the model shape as metadata."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_model(model, str(tmp), metadata={"foldtrain_shape": json.dumps(shape or {})})
    faults.point("export")
    tmp.replace(path)
    return path


def import_safetensors(model: nn.Module, path: str | Path) -> None:
    load_model(model, str(path))
