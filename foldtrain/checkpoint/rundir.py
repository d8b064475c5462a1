"""The run directory before training starts: is it writable, is it ours, where do we resume from.

Runs on every rank before any process group exists, so every rank reaches the same decision from
the same files, and bad input is one line with nothing touched.

* A **first attempt** (no torchrun, or ``TORCHELASTIC_RESTART_COUNT`` 0) never overwrites a run: a
  ``--out`` holding checkpoints needs ``--resume``, and ``--resume`` needs a checkpoint whose
  checksums verify (else one line naming the damaged file and the newest intact checkpoint).
  Under torchrun, rank 0 of a first attempt that may proceed records the job in ``--out/.job.json``
  (torchrun's rendezvous id; on one node also the host and the agent's pid).
* An attempt **restarted by torchrun** (``TORCHELASTIC_RESTART_COUNT`` >= 1) whose job owns ``--out``
  resumes by itself from the newest intact checkpoint (skipping damaged ones, with one line saying
  so), or starts over if the failure came before the first checkpoint (if every checkpoint is
  damaged it stops with one line instead). A restart whose job does not
  own ``--out`` (its first attempt was refused) follows the first-attempt rules: an unrelated run is
  never resumed, overwritten or extended.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from foldtrain.checkpoint.integrity import read_meta
from foldtrain.checkpoint.manager import CheckpointManager
from foldtrain.errors import CheckpointError, ConfigError

JOB_FILE = ".job.json"


@dataclass
class RunPlan:
    ckpt: CheckpointManager
    resume_from: Path | None  # None: start at step 0
    notice: str | None = None  # one line for the log (automatic resume, fallback)


def restart_count(env=os.environ) -> int:
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def job_identity(env=os.environ) -> dict | None:
    """What identifies this torchrun job across its restarts (None without torchrun)."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    ident = {"run_id": run_id}
    if env.get("LOCAL_WORLD_SIZE", "1") == env.get("WORLD_SIZE", "1"):  # one node: the agent's pid pins the invocation
        ident.update(host=socket.gethostname(), agent_pid=os.getppid())
    return ident


def check_writable(out: Path) -> None:
    """One line if ``out`` (or where it would be created) cannot hold a run; creates nothing that stays."""
    if not str(out).strip():
        raise ConfigError("--out is empty; pass the directory for the run, e.g. --out runs/mine")
    for p in (out, out / "checkpoints"):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--out {out}: {p} is a file, not a directory; choose another --out")
    probe = out / "checkpoints" if (out / "checkpoints").is_dir() else out
    while not probe.exists():
        if probe.is_symlink():
            raise ConfigError(f"--out {out}: {probe} is a broken symbolic link; fix it or choose another --out")
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--out {out}: {probe} is a file, not a directory; choose another --out")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".foldtrain-probe-", dir=probe))
    except OSError as e:
        raise ConfigError(
            f"--out {out} cannot be written (creating a directory in {probe} fails: {e.strerror}); "
            "choose a writable --out"
        ) from None


def _owned(out: Path, ident: dict | None) -> bool:
    if ident is None:
        return False
    try:
        return json.loads((out / JOB_FILE).read_text()) == ident
    except (OSError, ValueError):
        return False


def _check_layout(path: Path, world_size: int, model: dict | None) -> None:
    meta = read_meta(path)
    saved = meta.get("world_size")
    if isinstance(saved, int) and saved != world_size:
        raise CheckpointError(
            f"checkpoint {path} was saved by {saved} processes, this launch has {world_size}; "
            f"resume with --nproc_per_node {saved} (the same layout)"
        )
    saved_model = {"padded_vocab": 0, **meta["model"]} if isinstance(meta.get("model"), dict) else None
    if model is not None and saved_model is not None and saved_model != model:
        diff = ", ".join(f"{k} {saved_model.get(k)} (now {v})" for k, v in model.items() if saved_model.get(k) != v)
        fix = "resume with the same --model settings"
        if all(saved_model.get(k) == v for k, v in model.items() if k != "padded_vocab"):
            fix = "resume with the --parallel.tp and --model.vocab_multiple it was saved with (the padding must match)"
        raise CheckpointError(f"checkpoint {path} holds another model shape: {diff}; {fix}")


def plan_run(
    out: str | Path, resume: bool, keep: int, world_size: int = 1, model: dict | None = None, env=os.environ
) -> RunPlan:
    """Decide where this attempt starts; see the module docstring. ``model``: the GPTShape fields to match."""
    out = Path(out)
    check_writable(out)
    ckpt = CheckpointManager(out / "checkpoints", keep=keep)
    restart = restart_count(env)
    ident = job_identity(env)
    if restart >= 1 and _owned(out, ident):
        path, skipped = ckpt.newest_intact()
        if skipped:
            first = skipped[0]
            fallback = f"skipped {len(skipped)} damaged checkpoint(s) ({first[0].name}: {first[1]}); "
        else:
            fallback = ""
        if path is None and skipped:  # never retrain over checkpoints that exist, damaged or not
            raise CheckpointError(
                f"restart {restart}: every checkpoint in {ckpt.root} is damaged ({first[0].name}: {first[1]}); "
                "nothing was changed; delete them to start over"
            )
        if path is None:
            return RunPlan(ckpt, None, f"restart {restart}: no intact checkpoint yet, starting over from step 0")
        _check_layout(path, world_size, model)
        return RunPlan(ckpt, path, f"restart {restart}: {fallback}resuming from {path}")
    latest = ckpt.latest()
    if resume:
        if latest is None:
            raise CheckpointError(
                f"--resume given but {ckpt.root} holds no checkpoint; drop --resume to start a new run"
            )
        ckpt.require_intact(latest, "nothing was changed")
        _check_layout(latest, world_size, model)
        plan = RunPlan(ckpt, latest, None)
    elif latest is not None:
        raise ConfigError(
            f"{out} already holds checkpoints; pass --resume to continue that run or choose another --out"
        )
    else:
        plan = RunPlan(ckpt, None, None)
    if restart == 0 and ident is not None and env.get("RANK", "0") == "0":
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"{JOB_FILE}.tmp"
        tmp.write_text(json.dumps(ident))
        tmp.replace(out / JOB_FILE)
    return plan
