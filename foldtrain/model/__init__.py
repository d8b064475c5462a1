"""The GPT model (``gpt``), its presets, initialisation and Hugging Face interop.

``GPT``, ``GPTShape`` and ``lm_loss`` are loaded on first use, so that reading presets or a
checkpoint's config (``foldtrain simulate``, ``plan``, config validation) does not import torch.
"""

from foldtrain.model.presets import PRESETS, analytic_param_count

__all__ = ["GPT", "GPTShape", "lm_loss", "PRESETS", "analytic_param_count"]


def __getattr__(name: str):
    if name in ("GPT", "GPTShape", "lm_loss"):
        from foldtrain.model import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module 'foldtrain.model' has no attribute {name!r}")
