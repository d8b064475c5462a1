"""The ``foldtrain`` command: prepare, train, eval, generate, export, plot, config, bench.

Every subcommand takes ``--config FILE`` and any number of ``--section.field value``
overrides; ``generate``/``eval`` read the run's saved config from ``--out`` first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from foldtrain.errors import CheckpointError, ConfigError, FoldtrainError, report
from foldtrain.hostmem import restart_with_glibc_tunables

USAGE = """foldtrain <command> [--config FILE] [--section.field VALUE ...]

commands:
  prepare    tokenize a corpus into memory-mapped token shards (--data.path IN --data.out DIR [--data.workers N])
  train      train a model (--out DIR, --resume, --model.preset, --train.steps, ...)
  eval       validation loss and perplexity of a run's latest (or --checkpoint) checkpoint
  generate   sample text from a run's checkpoint (--prompt, --max_tokens, --temperature, --top_k)
  export     write a run as a Hugging Face GPT-2 directory (--out RUN --hf DIR)
  plot       loss, validation loss and tokens/s of runs, overlaid (RUN [RUN ...] [--out PNG])
  config     print the resolved config as TOML (list every key with --keys)
  bench      benchmarks (see `foldtrain bench --help`)
  simulate   predict a train configuration on a cluster (--cluster NAME|FILE, --json, --profile DIR)
  plan       search the layouts of a model on a cluster (--model.preset, --cluster, --gpus, --out)
  calibrate  measure this machine into a cluster file (--out FILE [--device cuda --preset P --precision bf16]
             [--network RATE --nodes N --ranks_per_node R])
"""


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"foldtrain {cmd}", allow_abbrev=False, add_help=True)
    p.add_argument("--config", help="TOML file with config sections")
    if cmd in ("eval", "generate", "export"):
        p.add_argument("--checkpoint", help="checkpoint directory (default: the run's latest)")
    if cmd == "generate":
        p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
        p.add_argument("--max_tokens", type=int, default=200)
        p.add_argument("--temperature", type=float, default=0.8)
        p.add_argument("--top_k", type=int, default=50)
        p.add_argument("--seed", type=int, default=0)
    if cmd == "export":
        p.add_argument(
            "--hf",
            required=True,
            metavar="DIR",
            help="new directory for config.json, model.safetensors and the tokenizer",
        )
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
            raise ConfigError(
                f"{out} holds no trained run (no config.toml); pass --out of a run made by `foldtrain train`"
            )
        config_file = str(saved)
    return build_config(rest, config_file)


def cmd_prepare(ns, rest) -> int:
    from foldtrain.data import prepare

    cfg = _config(ns, rest)
    d = cfg.data
    if not d.out:
        raise ConfigError("prepare needs an output directory; pass --data.out DIR")
    meta = prepare(
        d.path or None,
        d.out,
        vocab_size=d.vocab_size,
        tokenizer_path=d.tokenizer,
        text_field=d.text_field,
        val_fraction=d.val_fraction,
        seed=d.seed,
        workers=d.workers,
        shard_mb=d.shard_mb,
        tokenizer_sample_mb=d.tokenizer_sample_mb,
        shard=d.shard,
        num_shards=d.num_shards,
    )
    if "part" in meta:
        print(f"prepared part {meta['part']} of {meta['num_shards']} ({meta['shards']} shard(s)) in {meta['staging']}")
        return 0
    splits = meta["splits"]
    print(
        f"prepared {d.out}: {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens, "
        f"vocab {meta['vocab_size']}, "
        f"{meta['n_documents']:,} documents in {len(meta['shards'])} shard(s)"
    )
    return 0


def cmd_train(ns, rest) -> int:
    from foldtrain.errors import EXIT_PREEMPTED
    from foldtrain.train.trainer import train

    summary = train(_config(ns, rest))
    if summary and summary.get("preempted"):
        return EXIT_PREEMPTED  # a checkpoint of the last step was saved; --resume continues
    return 0 if summary else 1


def _load_run_model(ns, cfg):
    """The model of a run, with weights from its latest (or the given) checkpoint."""
    from foldtrain.checkpoint import CheckpointManager
    from foldtrain.checkpoint.manager import load_model_weights
    from foldtrain.distributed import pick_device
    from foldtrain.train.trainer import build_model, open_data

    data = open_data(cfg)
    if ns.checkpoint:
        path = Path(ns.checkpoint)
    else:
        path = CheckpointManager(Path(cfg.out) / "checkpoints").latest()
        if path is None:
            raise CheckpointError(
                f"{cfg.out} holds no checkpoint; train first or pass --checkpoint DIR of a saved step"
            )
    cfg.model.init_from = ""  # the weights come from the checkpoint
    model = build_model(cfg)
    load_model_weights(model, path)
    device = pick_device(cfg.train.device, 0)
    return model.to(device), data, device, path


def cmd_eval(ns, rest) -> int:
    import math

    from foldtrain.data import val_batches
    from foldtrain.engine import ReplicatedEngine

    cfg = _config(ns, rest, from_run=True)
    model, data, device, path = _load_run_model(ns, cfg)
    engine = ReplicatedEngine(model, cfg, device, cfg.train.micro_batch or cfg.train.global_batch)
    loss = engine.eval_loss(
        val_batches(data.split("val"), cfg.train.seq_len, engine.micro_batch, cfg.train.eval_batches)
    )
    print(
        json.dumps(
            {"checkpoint": str(path), "val_loss": round(loss, 6), "val_ppl": round(math.exp(min(loss, 50.0)), 4)}
        )
    )
    return 0


def cmd_generate(ns, rest) -> int:
    from foldtrain.train.trainer import generate_text

    cfg = _config(ns, rest, from_run=True)
    model, data, device, _ = _load_run_model(ns, cfg)
    if ns.max_tokens <= 0:
        raise ConfigError(f"--max_tokens must be > 0, got {ns.max_tokens}")
    print(generate_text(model, data, cfg, ns.prompt, ns.max_tokens, device, ns.temperature, ns.top_k, ns.seed))
    return 0


def cmd_export(ns, rest) -> int:
    from foldtrain.model.hf import export_hf
    from foldtrain.model.hf_config import SHAPE_KEYS

    target = Path(ns.hf).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"--hf {target} already exists and is not an empty directory; choose a new directory")
    cfg = _config(ns, rest, from_run=True)
    model, data, _, path = _load_run_model(ns, cfg)
    shape = {k: getattr(cfg.model, k) for k in SHAPE_KEYS}
    export_hf(model.state_dict(), shape, target, data.tokenizer_path, data.eot_id, cfg.model.dropout)
    print(
        f"exported {path} to {target}: config.json, model.safetensors, tokenizer "
        "(GPT2LMHeadModel / AutoTokenizer.from_pretrained)"
    )
    return 0


def cmd_plot(argv: list[str]) -> int:
    from foldtrain.plot import plot_runs

    p = argparse.ArgumentParser(prog="foldtrain plot", allow_abbrev=False)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (--out of foldtrain train)")
    p.add_argument(
        "--out",
        metavar="PNG",
        help="image to write (default: RUN/plot.png for one run, ./foldtrain-plot.png for several)",
    )
    ns = p.parse_args(argv)
    print(f"wrote {plot_runs(ns.runs, ns.out)}")
    return 0


def cmd_config(ns, rest) -> int:
    from foldtrain.config import all_keys, to_toml

    cfg = _config(ns, rest)
    print("\n".join("--" + k for k in all_keys(cfg)) if ns.keys else to_toml(cfg))
    return 0


# --- simulator commands (issue 8): own argument parsing, in foldtrain/sim_cli.py
def _sim_command(cmd: str, argv: list[str]) -> int:
    from foldtrain import sim_cli

    return {"simulate": sim_cli.simulate_main, "plan": sim_cli.plan_main, "calibrate": sim_cli.calibrate_main}[cmd](
        argv
    )


SIM_COMMANDS = ("simulate", "plan", "calibrate")
# --- end of the simulator commands


def cmd_bench(argv: list[str]) -> int:
    from foldtrain.bench import main as bench_main

    return bench_main(argv)


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "export": cmd_export,
    "config": cmd_config,
}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's entry point, not a call from Python
        restart_with_glibc_tunables()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    from foldtrain import faults

    faults.install()  # test-only fault injection; a no-op unless FOLDTRAIN_FAULT is set
    try:
        if cmd == "bench":
            return cmd_bench(rest)
        if cmd == "plot":
            return cmd_plot(rest)
        if cmd in SIM_COMMANDS:
            return _sim_command(cmd, rest)
        if cmd not in COMMANDS:
            raise ConfigError(
                f"unknown command '{cmd}'; choose one of: {', '.join([*COMMANDS, 'plot', 'bench', *SIM_COMMANDS])}"
            )
        ns, extra = _parser(cmd).parse_known_args(rest)
        return COMMANDS[cmd](ns, extra)
    except FoldtrainError as e:
        report(e)
        return 2
    except KeyboardInterrupt:
        print("foldtrain: interrupted", file=sys.stderr)
        return 130
