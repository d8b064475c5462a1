"""The main job's path: the built-in default corpus, the tiny preset, a short run whose loss falls."""

import json

from foldtrain.config import build_config
from foldtrain.data import TokenData, resolve_data
from foldtrain.train.trainer import train


def test_loss_falls_on_default_corpus(tmp_path, capsys):
    cfg = build_config(
        [
            "--train.steps",
            "30",
            "--train.global_batch",
            "8",
            "--train.seq_len",
            "64",
            "--train.eval_every",
            "0",
            "--train.eval_batches",
            "2",
            "--train.sample_tokens",
            "30",
            "--optim.warmup_steps",
            "5",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    data = TokenData.open(resolve_data(cfg.data))  # prepared once per machine (~30-60 s), then cached
    assert data.vocab_size == 8192 and data.split("train").shape[0] > 8_000_000  # the ~8.6M-token stdlib corpus
    train(cfg)
    rec = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(r["loss"] for r in rec[:3]) / 3, sum(r["loss"] for r in rec[-3:]) / 3
    assert first > 8.5 and last < first - 1.5, (first, last)
    assert "----- sample after 30 steps -----" in capsys.readouterr().out
