"""Shared fixtures: a small prepared dataset built from real text (a slice of the stdlib), and a one-rank gloo
process group."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

TINY_ARGS = [
    "--model.preset",
    "tiny",
    "--model.n_layer",
    "2",
    "--model.d_model",
    "32",
    "--model.n_head",
    "2",
    "--model.context",
    "64",
    "--model.vocab_size",
    "512",
]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """~40 real source files copied into a directory (raw input for prepare)."""
    from foldtrain.data import default_corpus_files

    root = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate(default_corpus_files(limit=40)):
        shutil.copy(f, root / f"{i:03d}_{f.name}")
    return root


@pytest.fixture(scope="session")
def small_data(small_corpus, tmp_path_factory) -> Path:
    """A prepared dataset (vocab 512) from ``small_corpus``."""
    from foldtrain.data import prepare

    out = tmp_path_factory.mktemp("prepared") / "small"
    prepare(small_corpus, out, vocab_size=512, val_fraction=0.1, seed=0, quiet=True)
    return out


def tiny_run_args(data: Path, out: Path, *extra: str) -> list[str]:
    """Command-line arguments for a fast run of a very small model on ``data``."""
    return [
        *TINY_ARGS,
        "--train.global_batch",
        "8",
        "--train.seq_len",
        "32",
        "--train.steps",
        "20",
        "--train.eval_every",
        "0",
        "--train.eval_batches",
        "2",
        "--train.sample_tokens",
        "0",
        "--train.progress",
        "false",
        "--optim.warmup_steps",
        "5",
        "--data.path",
        str(data),
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank gloo process group for the test (a FileStore in ``tmp_path``), destroyed after it."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
