"""The ``foldtrain`` command: prepare, train, eval, generate, config, bench.

Every subcommand takes ``--config FILE`` and any number of ``--section.field value``
overrides; ``generate``/``eval`` read the run's saved config from ``--out`` first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from foldtrain.errors import ConfigError, FoldtrainError

USAGE = """foldtrain <command> [--config FILE] [--section.field VALUE ...]

commands:
  prepare    tokenize a corpus into memory-mapped token shards (--data.path IN --data.out DIR [--data.workers N])
  train      train a model (--out DIR, --resume, --model.preset, --train.steps, ...)
  eval       validation loss and perplexity of a run's latest (or --checkpoint) checkpoint
  generate   sample text from a run's checkpoint (--prompt, --max_tokens, --temperature, --top_k)
  config     print the resolved config as TOML (list every key with --keys)
  bench      benchmarks (see `foldtrain bench --help`)
"""


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"foldtrain {cmd}", allow_abbrev=False, add_help=True)
    p.add_argument("--config", help="TOML file with config sections")
    if cmd in ("eval", "generate"):
        p.add_argument("--checkpoint", help="checkpoint directory (default: the run's latest)")
    if cmd == "generate":
        p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
        p.add_argument("--max_tokens", type=int, default=200)
        p.add_argument("--temperature", type=float, default=0.8)
        p.add_argument("--top_k", type=int, default=50)
        p.add_argument("--seed", type=int, default=0)
    if cmd == "config":
        p.add_argument("--keys", action="store_true", help="list every config key")
    return p


def _config(ns: argparse.Namespace, rest: list[str], from_run: bool = False):
    from foldtrain.config import build_config, parse_overrides

    config_file = ns.config
    if from_run and not config_file:
        out = dict(parse_overrides(rest)).get("out", "runs/default")
        saved = Path(str(out)) / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"{out} holds no trained run (no config.toml); pass --out of a run made by `foldtrain train`")
        config_file = str(saved)
    return build_config(rest, config_file)


def cmd_prepare(ns, rest) -> int:
    from foldtrain.data import prepare

    cfg = _config(ns, rest)
    d = cfg.data
    if not d.out:
        raise ConfigError("prepare needs an output directory; pass --data.out DIR")
    meta = prepare(d.path or None, d.out, vocab_size=d.vocab_size, tokenizer_path=d.tokenizer, text_field=d.text_field, val_fraction=d.val_fraction, seed=d.seed,
                   workers=d.workers, shard_mb=d.shard_mb, tokenizer_sample_mb=d.tokenizer_sample_mb, shard=d.shard, num_shards=d.num_shards)
    if "part" in meta:
        print(f"prepared part {meta['part']} of {meta['num_shards']} ({meta['shards']} shard(s)) in {meta['staging']}")
        return 0
    splits = meta["splits"]
    print(f"prepared {d.out}: {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens, vocab {meta['vocab_size']}, "
          f"{meta['n_documents']:,} documents in {len(meta['shards'])} shard(s)")
    return 0


def cmd_train(ns, rest) -> int:
    from foldtrain.train.trainer import train

    summary = train(_config(ns, rest))
    return 0 if summary else 1


def _load_run_model(ns, cfg):
    """The model of a run, with weights from its latest (or the given) checkpoint."""
    from foldtrain.checkpoint.manager import load_model_weights
    from foldtrain.distributed import pick_device
    from foldtrain.train.trainer import build_model, check_run_dir, open_data

    data = open_data(cfg)
    if ns.checkpoint:
        path = Path(ns.checkpoint)
    else:
        cfg.resume = True
        path = check_run_dir(cfg).latest()
    model = build_model(cfg)
    load_model_weights(model, path)
    device = pick_device(cfg.train.device, 0)
    return model.to(device), data, device, path


def cmd_eval(ns, rest) -> int:
    import math

    from foldtrain.data import val_batches
    from foldtrain.train.engine import Engine

    cfg = _config(ns, rest, from_run=True)
    model, data, device, path = _load_run_model(ns, cfg)
    engine = Engine(model, cfg, device, cfg.train.micro_batch or cfg.train.global_batch)
    loss = engine.eval_loss(val_batches(data.split("val"), cfg.train.seq_len, engine.micro_batch, cfg.train.eval_batches))
    print(json.dumps({"checkpoint": str(path), "val_loss": round(loss, 6), "val_ppl": round(math.exp(min(loss, 50.0)), 4)}))
    return 0


def cmd_generate(ns, rest) -> int:
    from foldtrain.train.trainer import generate_text

    cfg = _config(ns, rest, from_run=True)
    model, data, device, _ = _load_run_model(ns, cfg)
    if ns.max_tokens <= 0:
        raise ConfigError(f"--max_tokens must be > 0, got {ns.max_tokens}")
    print(generate_text(model, data, cfg, ns.prompt, ns.max_tokens, device, ns.temperature, ns.top_k, ns.seed))
    return 0


def cmd_config(ns, rest) -> int:
    from foldtrain.config import all_keys, to_toml

    cfg = _config(ns, rest)
    print("\n".join("--" + k for k in all_keys(cfg)) if ns.keys else to_toml(cfg))
    return 0


def cmd_bench(argv: list[str]) -> int:
    from foldtrain.bench import main as bench_main

    return bench_main(argv)


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "config": cmd_config}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "bench":
            return cmd_bench(rest)
        if cmd not in COMMANDS:
            raise ConfigError(f"unknown command '{cmd}'; choose one of: {', '.join([*COMMANDS, 'bench'])}")
        ns, extra = _parser(cmd).parse_known_args(rest)
        return COMMANDS[cmd](ns, extra)
    except FoldtrainError as e:
        print(f"foldtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("foldtrain: interrupted", file=sys.stderr)
        return 130
