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

from foldtrain import faults
from foldtrain.checkpoint import RunPlan, export_safetensors, plan_run
from foldtrain.checkpoint.rundir import restart_count
from foldtrain.config import Config, dp_workers, to_toml, validate
from foldtrain.data import SequenceSampler, TokenData, load_tokenizer, open_dataset, val_batches
from foldtrain.distributed import (
    DistEnv,
    check_same_data,
    gather_floats,
    init_distributed,
    launch_world_size,
    shutdown,
)
from foldtrain.engine import build_engine
from foldtrain.errors import EXIT_PREEMPTED, ConfigError, FoldtrainError, report
from foldtrain.hostmem import keep_freed_host_memory
from foldtrain.model import GPT, GPTShape, analytic_param_count
from foldtrain.model.generate import sample
from foldtrain.model.hf import maybe_init_from
from foldtrain.schedules.layout import uses_3d_engine
from foldtrain.train.advice import warnings_for
from foldtrain.train.metrics import RunLogger, peak_memory_mb
from foldtrain.train.preempt import Preemption


def model_shape(cfg: Config) -> GPTShape:
    """The model's shape, its vocabulary padded for ``--model.vocab_multiple`` and ``--parallel.tp``."""
    return GPTShape.from_config(cfg.model, cfg.parallel.tp)


def check_run_dir(cfg: Config, world: int = 1) -> RunPlan:
    """Refuse an unwritable --out, to clobber an existing run and to resume from a damaged checkpoint;
    after a torchrun restart, resume by itself from the newest intact checkpoint (checkpoint/rundir.py)."""
    return plan_run(cfg.out, cfg.resume, cfg.checkpoint.keep, world, model_shape(cfg).__dict__)


def open_data(cfg: Config) -> TokenData:
    data = open_dataset(cfg.data)  # --data.mix or --data.path (prepared if needed)
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer's vocabulary ({data.vocab_size}) is larger than the model's embedding "
            f"({cfg.model.vocab_size}); set --model.vocab_size {data.vocab_size} "
            "or prepare data with a smaller --data.vocab_size"
        )
    return data


def build_model(cfg: Config, meta: bool = False) -> GPT:
    """The GPT of ``cfg`` with the run's initial weights (identical on every rank), or those of
    ``--model.init_from``. ``meta``: on the meta device, holding no memory, for engines that
    materialise only their own part of it (not with ``--model.init_from``, whose weights are read whole)."""
    torch.manual_seed(cfg.train.seed)
    shape = model_shape(cfg)
    if meta and not cfg.model.init_from:
        with torch.device("meta"):
            return GPT(shape, cfg.train.seed)
    return maybe_init_from(cfg, GPT(shape, cfg.train.seed))


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured; returns a summary of the final state."""
    world = launch_world_size()
    validate(cfg, world)
    plan = check_run_dir(cfg, world)
    cfg.resume = plan.resume_from is not None  # also after a restart that resumes by itself
    data = open_data(cfg)
    env = init_distributed(cfg.train.device, cfg.dp.timeout_s)
    if env.device.type == "cpu" and cfg.train.malloc_cache:
        keep_freed_host_memory()
    try:
        check_same_data(data.fingerprint)  # every rank trains on the same prepared data (meta.json checksums)
        return _train(cfg, env, data, plan)
    except FoldtrainError as e:
        report(e)  # now: shutdown() below can take long enough for torchrun's SIGTERM to arrive first
        raise
    finally:
        shutdown()


def _train(cfg: Config, env: DistEnv, data: TokenData, plan: RunPlan) -> dict:
    out, t = Path(cfg.out), cfg.train
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
    model = build_model(cfg, meta=uses_3d_engine(cfg))  # a pipeline rank materialises only its chunks
    n_params = model.num_params()
    workers = dp_workers(cfg, env.world_size)
    micro = t.micro_batch or t.global_batch // workers
    engine = build_engine(cfg, model, env, micro)
    sampler = SequenceSampler(data.split("train"), t.seq_len, cfg.train.seed)
    val = val_batches(data.split("val"), t.seq_len, micro, t.eval_batches)
    start = resume_or_seed(cfg, env, engine, plan)

    resumed = plan.resume_from is not None or restart_count() >= 1  # also a restart that starts over
    log = RunLogger(out, env.is_main, t.steps, start, t.progress, resumed=resumed)
    log_start(log, cfg, env, data, len(sampler), n_params, plan, start)
    for warning in warnings_for(cfg, data.vocab_size):
        log.info(f"warning: {warning}")
    end = min(t.steps, t.stop_at) if t.stop_at else t.steps
    c = cfg.checkpoint
    with Preemption(c.on_signal, c.signals, c.signal_timeout_s, env.device) as preempt:
        loss, stopped = train_steps(cfg, env, engine, sampler, val, plan, log, start, end, preempt)
    if stopped is not None:
        log.close()
        return {"step": stopped, "loss": loss, "params": n_params, "preempted": True}
    summary = {"step": end, "loss": loss, "params": n_params}
    if end < t.steps:
        log.info(f"stopped at step {end} of {t.steps} (--train.stop_at); continue with --resume")
        log.close()
        return summary
    finish(cfg, env, engine, data, log)
    return summary


def resume_or_seed(cfg: Config, env: DistEnv, engine, plan: RunPlan) -> int:
    """The step the loop starts from: the checkpoint's when resuming (its state loaded into ``engine``),
    else 0 with this rank's dropout stream seeded."""
    if plan.resume_from is None:
        # dropout streams differ per data/pipeline rank; tensor-parallel ranks share one (replicated activations)
        torch.manual_seed(cfg.train.seed + 1000 * (env.rank // cfg.parallel.tp))
        return 0
    state = engine.state_dict()
    meta, _ = plan.ckpt.load(plan.resume_from, state)
    engine.load_state_dict(state)
    return int(meta["step"])


def log_start(
    log: RunLogger, cfg: Config, env: DistEnv, data: TokenData, sequences: int, n_params: int, plan: RunPlan, start: int
) -> None:
    """The run's first lines: model, processes, data, and where it resumed from."""
    m, t = cfg.model, cfg.train
    rows = model_shape(cfg).embedding_rows
    analytic = analytic_param_count(m.n_layer, m.d_model, m.context, rows)
    padded = f", vocabulary {m.vocab_size:,} padded to {rows:,} rows" if rows > m.vocab_size else ""
    log.info(
        f"model {m.preset}: {n_params:,} parameters (analytic {analytic:,}{padded}); "
        f"{env.world_size} process(es), strategy {cfg.dp.strategy}, precision {cfg.precision}, device {env.device}"
    )
    n_train, n_val = data.split("train").shape[0], data.split("val").shape[0]
    log.info(
        f"data: {n_train:,} train / {n_val:,} val tokens, vocab {data.vocab_size}; "
        f"{sequences:,} sequences of {t.seq_len}"
    )
    if plan.notice:
        log.info(plan.notice)
    if plan.resume_from is not None:
        log.info(f"resumed from {plan.resume_from} at step {start}")


def train_steps(
    cfg: Config,
    env: DistEnv,
    engine,
    sampler,
    val,
    plan: RunPlan,
    log: RunLogger,
    start: int,
    end: int,
    preempt: Preemption,
) -> tuple[float, int | None]:
    """Steps ``start + 1 .. end``, each logged every ``--train.log_every`` steps and checkpointed every
    ``--checkpoint.every`` (and at ``end``); the last step's loss (nan when no step ran), and the step
    after which a signal stopped the run with a checkpoint (None: it reached ``end``)."""
    t = cfg.train
    meta = {
        "world_size": env.world_size,
        "strategy": cfg.dp.strategy,
        "model": model_shape(cfg).__dict__,
        "data_step": 0,
    }
    loss = float("nan")
    t_start = time.perf_counter()  # metrics' time_s: wall time since this session's loop began

    def share() -> list[float]:  # what every rank needs of every other after a step, carried by the engine's collective
        return [preempt.flag(), peak_memory_mb(env.device)]  # (column() reads them back by these positions)

    for step in range(start, end):
        faults.step(step + 1)  # no-op unless FOLDTRAIN_FAULT is set (tests only)
        t0 = time.perf_counter()
        lr = engine.lr  # the rate this step uses
        x, y = engine.batch(sampler, step)
        loss = engine.train_step(x, y, share=share)
        dt = time.perf_counter() - t0
        if not math.isfinite(loss) and cfg.precision != "fp16":
            raise FloatingPointError(f"loss became {loss} at step {step + 1}; lower --optim.lr or use --precision fp32")
        done = step + 1
        if done % t.log_every == 0 or done == t.steps:
            record = step_record(cfg, env, engine, val, done, loss, lr, dt, t_start)
            log.log(record, advance=t.log_every if done % t.log_every == 0 else done % t.log_every)
        stop = preempt.stop_agreed(column(engine.shared, 0))  # every rank stops after the same step
        if stop or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == end:
            # the last save and a preemption's save are written at once; the others may go to the background
            background = cfg.checkpoint.async_ and not stop and done != end
            path = plan.ckpt.save(
                done,
                engine.state_dict(),
                {**meta, "data_step": done},
                extra=engine.extra_state(),
                background=background,
            )
        engine.between_steps()  # after this step's collectives above: on a slow link they would queue behind it
        if stop and done < end:
            log.info(
                f"preempted: {preempt.describe()} received; saved {path} after step {done} of {t.steps}; "
                f"exiting with {EXIT_PREEMPTED}, continue with --resume"
            )
            return loss, done
    return loss, None


def step_record(
    cfg: Config, env: DistEnv, engine, val, done: int, loss: float, lr: float, dt: float, t_start: float
) -> dict:
    """The metrics line of step ``done``; with the validation loss at ``--train.eval_every`` and the last step.
    Collective on every rank (peak memory of all ranks, engine statistics, evaluation)."""
    t = cfg.train
    record = {
        "step": done,
        "loss": loss,
        "lr": lr,
        "tokens_per_s": t.global_batch * t.seq_len / dt,
        "step_time_s": dt,
        "time_s": time.perf_counter() - t_start,
        "grad_norm": engine.last_grad_norm,
        **memory_record(env, column(engine.shared, 1)),
        **engine.stats(),
    }
    if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
        record["val_loss"] = engine.eval_loss(val)
        record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
    return record


def finish(cfg: Config, env: DistEnv, engine, data: TokenData, log: RunLogger) -> None:
    """After the last step: rank 0 exports the final model (``--checkpoint.safetensors``) and prints a sample;
    every rank takes part in building that model."""
    if not env.is_main:
        engine.eval_model()  # collective on some layouts (gathering a sharded model)
        return
    t = cfg.train
    log.close()
    full = engine.eval_model()
    if cfg.checkpoint.safetensors and full is not None:
        export_safetensors(full, Path(cfg.out) / "model.safetensors", model_shape(cfg).__dict__)
    if t.sample_tokens and full is not None:
        text = generate_text(full, data, cfg, prompt=t.sample_prompt, max_new_tokens=t.sample_tokens, device=env.device)
        print(f"\n----- sample after {t.steps} steps -----\n{text}\n-----", flush=True)


def column(shared: list[list[float]] | None, i: int) -> list[float] | None:
    """Every rank's ``i``-th value of the loop's ``share()`` as the engine's step carried it (None: not carried)."""
    return None if shared is None else [s[i] for s in shared]


def memory_record(env: DistEnv, carried: list[float] | None = None) -> dict:
    """This rank's peak memory and, with several ranks, every rank's and the largest: ``carried`` by the
    engine's step (every rank's, in rank order), or gathered by a collective of its own."""
    mine = peak_memory_mb(env.device)
    if env.world_size == 1:
        return {"peak_mem_mb": mine}
    if carried is None:
        ranks = gather_floats(mine)
    else:
        ranks, mine = carried, carried[env.rank]
    return {"peak_mem_mb": mine, "peak_mem_mb_max": max(ranks), "peak_mem_mb_ranks": ranks}


def generate_text(
    model: torch.nn.Module,
    data: TokenData,
    cfg: Config,
    prompt: str,
    max_new_tokens: int,
    device: torch.device,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    tok = load_tokenizer(data.tokenizer_path)
    ids = tok.encode(prompt).ids if prompt else [data.eot_id]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = sample(model, idx, max_new_tokens, cfg.model.context, temperature, top_k, generator=gen)
    return tok.decode(out[0].tolist()[len(ids) if prompt == "" else 0 :])
