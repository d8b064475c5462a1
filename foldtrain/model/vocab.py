"""A padded vocabulary at the boundary of the process: exports hold the true vocabulary, models may be padded.

``GPTShape.padded_vocab`` rows (a multiple of ``--model.vocab_multiple`` and of tp) live only in memory and
in the run's own checkpoints; every file meant for another program (``model.safetensors``, a Hugging Face
directory) holds ``vocab_size`` rows. ``strip_padding`` cuts the padding rows from a state dict,
``pad_rows`` adds zero rows to the loaded one so it fits a padded model.
"""

from __future__ import annotations

import torch

VOCAB_ROWS = ("wte.weight", "lm_head.weight")  # name suffixes of the tensors with one row per vocabulary id


def _is_vocab_tensor(name: str) -> bool:
    return name.endswith(VOCAB_ROWS)


def strip_padding(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """``state`` with the vocabulary tensors cut to their first ``vocab_size`` rows (views, nothing copied)."""
    return {k: v[:vocab_size] if _is_vocab_tensor(k) and v.shape[0] > vocab_size else v for k, v in state.items()}


def pad_rows(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``state`` with the vocabulary tensors grown to ``rows`` rows by zero rows (the padding's initial value)."""
    out = {}
    for k, v in state.items():
        if _is_vocab_tensor(k) and v.shape[0] < rows:
            v = torch.cat([v, v.new_zeros((rows - v.shape[0], *v.shape[1:]))])
        out[k] = v
    return out
