"""Model shape presets (plain data, no torch).

``n_layer``, ``n_head``, ``d_model``, ``context`` (max positions) and
``vocab_size``. GPT-2 shapes follow the released checkpoints, ``bai2022`` is
the HP3C'22 study's model (character-level Chinese vocabulary of ~26.7k) and
the GPT-3 shapes follow Brown et al. 2020, Table 2.1 (16 heads for 1.3B so the
head size is a whole 128, and 5120 instead of the table's 5140 for 13B).
"""

import math

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=96, context=256, vocab_size=8192),
    "gpt2-small": dict(n_layer=12, n_head=12, d_model=768, context=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, context=1024, vocab_size=50257),
    "gpt2-large": dict(n_layer=36, n_head=20, d_model=1280, context=1024, vocab_size=50257),
    "gpt2-xl": dict(n_layer=48, n_head=25, d_model=1600, context=1024, vocab_size=50257),
    "bai2022": dict(n_layer=12, n_head=12, d_model=768, context=512, vocab_size=26700),
    "gpt3-1.3b": dict(n_layer=24, n_head=16, d_model=2048, context=2048, vocab_size=50257),
    "gpt3-2.7b": dict(n_layer=32, n_head=32, d_model=2560, context=2048, vocab_size=50257),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, d_model=4096, context=2048, vocab_size=50257),
    "gpt3-13b": dict(n_layer=40, n_head=40, d_model=5120, context=2048, vocab_size=50257),
    "gpt3-175b": dict(n_layer=96, n_head=96, d_model=12288, context=2048, vocab_size=50257),
}


def padded_vocab(vocab_size: int, multiple: int = 1, tp: int = 1) -> int:
    """Rows of the embedding for ``vocab_size`` words: the next multiple of both ``multiple`` and ``tp``
    (tensor parallelism splits the embedding and the output layer over the vocabulary), as Megatron's
    ``make-vocab-size-divisible-by`` does."""
    step = math.lcm(max(int(multiple), 1), max(int(tp), 1))
    return -(-vocab_size // step) * step


def vocab_slice(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s part of ``rows`` vocabulary rows split over ``world`` ranks as
    ``Shard(0)`` (``torch.chunk``) splits them: ceil-sized pieces first, so the last ranks may get fewer or none."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def analytic_param_count(n_layer: int, d_model: int, context: int, vocab_size: int) -> int:
    """Parameters of the GPT-2 architecture with biases and tied embeddings.

    token + position embeddings, per block two LayerNorms (2d each), qkv
    (3d^2 + 3d), attention projection (d^2 + d), MLP (4d^2 + 4d, 4d^2 + d),
    and the final LayerNorm; the head shares the token embedding.
    """
    d = d_model
    per_block = 12 * d * d + 13 * d
    return vocab_size * d + context * d + n_layer * per_block + 2 * d


def train_flops_per_token(params: float, n_layer: int, seq_len: int, d_model: int) -> float:
    """Model FLOPs of one training token: 6 N for the matrix products of forward and backward (N every
    parameter, the tied embedding once) plus 12 L T d for attention's scores and weighted sum (Narayanan et
    al. 2021; PaLM's MFU). What every MFU foldtrain reports counts (the simulator's, the acceptance run's,
    the GPU validation's ``palm``)."""
    return 6.0 * params + 12.0 * n_layer * seq_len * d_model
