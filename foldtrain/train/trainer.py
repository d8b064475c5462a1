"""The training loop: data, model, engine, checkpoints, logging. Readable in one sitting.

Order of work (so that bad input fails fast, before any process group exists):
validate config -> check the run directory and checkpoints -> prepare/open data -> check the data
against the model -> join the process group -> build model and engine -> resume -> loop.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from foldtrain.checkpoint import CheckpointManager, export_safetensors
from foldtrain.config import Config, dp_workers, to_toml, validate
from foldtrain.data import SequenceSampler, TokenData, load_tokenizer, open_dataset, val_batches
from foldtrain.distributed import DistEnv, init_distributed, launch_world_size, shutdown
from foldtrain.errors import CheckpointError, ConfigError
from foldtrain.generate import sample
from foldtrain.model import GPT, GPTShape, analytic_param_count
from foldtrain.parallel import build_engine
from foldtrain.train.metrics import RunLogger, peak_memory_mb


def check_run_dir(cfg: Config) -> CheckpointManager:
    """Refuse to clobber an existing run, and refuse --resume without a checkpoint."""
    ckpt = CheckpointManager(Path(cfg.out) / "checkpoints", keep=cfg.checkpoint.keep)
    latest = ckpt.latest()
    if cfg.resume and latest is None:
        raise CheckpointError(f"--resume given but {ckpt.root} holds no checkpoint; drop --resume to start a new run")
    if not cfg.resume and latest is not None:
        raise ConfigError(f"{cfg.out} already holds checkpoints; pass --resume to continue that run or choose another --out")
    return ckpt


def open_data(cfg: Config) -> TokenData:
    data = open_dataset(cfg.data)  # --data.mix or --data.path (prepared if needed)
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer's vocabulary ({data.vocab_size}) is larger than the model's embedding ({cfg.model.vocab_size}); "
            f"set --model.vocab_size {data.vocab_size} or prepare data with a smaller --data.vocab_size"
        )
    return data


def build_model(cfg: Config) -> GPT:
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    return GPT(GPTShape.from_config(cfg.model))


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured; returns a summary of the final state."""
    world = launch_world_size()
    validate(cfg, world)
    ckpt = check_run_dir(cfg)
    data = open_data(cfg)
    env = init_distributed(cfg.train.device, cfg.dp.timeout_s)
    try:
        return _train(cfg, env, data, ckpt)
    finally:
        shutdown()


def _train(cfg: Config, env: DistEnv, data: TokenData, ckpt: CheckpointManager) -> dict:
    out = Path(cfg.out)
    t = cfg.train
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
    model = build_model(cfg)
    n_params = model.num_params()
    analytic = analytic_param_count(cfg.model.n_layer, cfg.model.d_model, cfg.model.context, cfg.model.vocab_size)
    workers = dp_workers(cfg, env.world_size)
    micro = t.micro_batch or t.global_batch // workers
    engine = build_engine(cfg, model, env, micro)
    sampler = SequenceSampler(data.split("train"), t.seq_len, cfg.train.seed)
    val = val_batches(data.split("val"), t.seq_len, micro, t.eval_batches)

    start = 0
    if cfg.resume:
        path = ckpt.latest()
        state = engine.state_dict()
        meta, _ = ckpt.load(path, state)
        engine.load_state_dict(state)
        start = int(meta["step"])
    else:
        # dropout streams differ per data/pipeline rank; tensor-parallel ranks share one (replicated activations)
        torch.manual_seed(cfg.train.seed + 1000 * (env.rank // cfg.parallel.tp))

    log = RunLogger(out, env.is_main, t.steps, start, t.progress)
    log.info(f"model {cfg.model.preset}: {n_params:,} parameters (analytic {analytic:,}); {env.world_size} process(es), strategy {cfg.dp.strategy}, precision {cfg.precision}, device {env.device}")
    log.info(f"data: {data.split('train').shape[0]:,} train / {data.split('val').shape[0]:,} val tokens, vocab {data.vocab_size}; {len(sampler):,} sequences of {t.seq_len}")
    if cfg.resume:
        log.info(f"resumed from {ckpt.latest()} at step {start}")

    tokens_per_step = t.global_batch * t.seq_len
    meta = {"world_size": env.world_size, "strategy": cfg.dp.strategy, "model": GPTShape.from_config(cfg.model).__dict__, "data_step": 0}
    loss = float("nan")
    end = min(t.steps, t.stop_at) if t.stop_at else t.steps
    for step in range(start, end):
        t0 = time.perf_counter()
        lr = engine.lr  # the rate this step uses
        x, y = engine.batch(sampler, step)
        loss = engine.train_step(x, y)
        dt = time.perf_counter() - t0
        if not math.isfinite(loss) and cfg.precision != "fp16":
            raise FloatingPointError(f"loss became {loss} at step {step + 1}; lower --optim.lr or use --precision fp32")
        done = step + 1
        if done % t.log_every == 0 or done == t.steps:
            record = {"step": done, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "grad_norm": engine.last_grad_norm, "peak_mem_mb": peak_memory_mb(env.device), **engine.stats()}
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                record["val_loss"] = engine.eval_loss(val)
                record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
            log.log(record, advance=t.log_every if done % t.log_every == 0 else done % t.log_every)
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == end:
            ckpt.save(done, engine.state_dict(), {**meta, "data_step": done}, extra=engine.extra_state())
    summary = {"step": end, "loss": loss, "params": n_params}
    if end < t.steps:
        log.info(f"stopped at step {end} of {t.steps} (--train.stop_at); continue with --resume")
        log.close()
        return summary
    if env.is_main:
        log.close()
        full = engine.eval_model()
        if cfg.checkpoint.safetensors and full is not None:
            export_safetensors(full, out / "model.safetensors", GPTShape.from_config(cfg.model).__dict__)
        if t.sample_tokens and full is not None:
            text = generate_text(full, data, cfg, prompt=t.sample_prompt, max_new_tokens=t.sample_tokens, device=env.device)
            print(f"\n----- sample after {t.steps} steps -----\n{text}\n-----", flush=True)
    else:
        engine.eval_model()  # collective on some layouts (gathering a sharded model)
    return summary


def generate_text(model: torch.nn.Module, data: TokenData, cfg: Config, prompt: str, max_new_tokens: int, device: torch.device, temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    tok = load_tokenizer(data.tokenizer_path)
    ids = tok.encode(prompt).ids if prompt else [data.eot_id]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = sample(model, idx, max_new_tokens, cfg.model.context, temperature, top_k, generator=gen)
    return tok.decode(out[0].tolist()[len(ids) if prompt == "" else 0 :])
