"""Pure functions of the benchmark: metrics.jsonl -> per-run medians (tables and ratios: :mod:`.tables`).

No torch, no processes: everything here is computed from dictionaries, so it is tested on
synthetic ``metrics.jsonl`` files.

A run is a :class:`RunResult`: what ran (``impl`` foldtrain or an anchor, ``variant`` = strategy
or schedule, precision, ranks, network), whether it worked (``error`` = the last meaningful line
of its output when not), the medians of its logged per-step metrics after warm-up
(:func:`summarize_records`) and, on the emulated network, the bytes each node's link carried per
step (``wire``: list of (sent, received) per node).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from foldtrain.profile.recorder import PROFILE_FILE

# keys of a metrics.jsonl record that are not per-step measurements
_NOT_MEASURED = {"step", "loss", "lr", "grad_norm", "val_loss", "val_ppl", "time_s"}


@dataclass
class RunResult:
    bench: str  # "dp" or "pipeline"
    impl: str  # "foldtrain" or an anchor: "ddp_plain", "horovod", "torch", "deepspeed"
    variant: str  # dp: the strategy; pipeline: the schedule
    precision: str = "fp32"
    ranks: int = 1  # processes in the job (world size)
    network: str = "loopback"
    workers: int = 1  # data-parallel workers (ranks computing gradients on distinct data)
    error: str = ""  # empty when the run worked
    metrics: dict[str, float] = field(default_factory=dict)  # medians after warm-up
    wire: list[tuple[float, float]] | None = None  # per node: (bytes sent, bytes received) per step
    info: dict[str, Any] = field(default_factory=dict)  # e.g. virtual, dp_sync, out, wall_s
    out_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def label(self) -> str:
        if self.impl == "foldtrain":
            return self.variant
        return f"{self.impl}:{self.variant}" if self.variant else self.impl

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        d = dict(d)
        if d.get("wire") is not None:
            d["wire"] = [tuple(x) for x in d["wire"]]
        return cls(**d)


# ---------------------------------------------------------------- reading runs


def _json_lines(p: Path) -> list[dict]:
    """The JSON objects of a .jsonl file, one per line (other lines skipped; none if it does not exist)."""
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_metrics(path: str | Path) -> list[dict]:
    """The per-step records of a metrics.jsonl, each with the figures ``--profile`` wrote for its step into
    the profile.jsonl beside it (lines that are not JSON objects are skipped)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    profiled = {r.get("step"): r for r in _json_lines(p.with_name(PROFILE_FILE))}
    return [{**profiled.get(rec.get("step"), {}), **rec} for rec in _json_lines(p) if "step_time_s" in rec]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _consistent_throughput(m: dict[str, float]) -> None:
    """tokens/s = tokens per step / the median step time (so the two columns always agree, also
    when a median falls between two steps or between repetitions)."""
    if m.get("tokens_per_step") and m.get("step_time_s"):
        m["tokens_per_s"] = m["tokens_per_step"] / m["step_time_s"]


def wall_periods(records: list[dict]) -> list[float | None]:
    """Each record's wall period: its ``time_s`` less the previous step's (None for a record whose
    previous step is not the record before it)."""
    out: list[float | None] = [None] * len(records)
    for i in range(1, len(records)):
        a, b = records[i - 1], records[i]
        if _num(a.get("time_s")) and _num(b.get("time_s")) and b.get("step") == (a.get("step") or 0) + 1:
            out[i] = float(b["time_s"]) - float(a["time_s"])
    return out


def summarize_records(records: list[dict], warmup: int = 3) -> dict[str, float]:
    """Medians of every numeric per-step measurement after the first ``warmup`` records.

    ``step_time_s`` is the wall period from one step's start to the next's (``time_s``), so that it holds
    what happens between steps too: the loop's logging, and the communication a step leaves in flight
    (deferred reductions, ZeRO's all-gathers), which the loop's own ``step_time_s`` (``engine_step_s`` here)
    would not charge to anyone. Records without a period keep their own ``step_time_s`` only when no
    record has one. ``peak_mem_mb`` is the maximum (it is a high-water mark). Derived per step before
    the median: ``comm_bytes`` (sent + received), ``comm_wait_share`` (comm_wait_s / the engine's step)
    and ``compute_share``. ``steps_measured`` says how many records the medians use. If there are no
    more than ``warmup`` records, the last one is used (and ``warmup_short`` is set)."""
    if not records:
        return {}
    periods = wall_periods(records)
    first = warmup if len(records) > warmup else len(records) - 1
    kept = list(zip(records[first:], periods[first:]))
    any_period = any(p is not None for _, p in kept)
    rows = []
    for r, period in kept:
        r = dict(r)
        if _num(r.get("comm_bytes_sent")) or _num(r.get("comm_bytes_recv")):
            r["comm_bytes"] = float(r.get("comm_bytes_sent") or 0) + float(r.get("comm_bytes_recv") or 0)
        st = r.get("step_time_s")
        if _num(st) and st > 0 and _num(r.get("tokens_per_s")):
            r["tokens_per_step"] = r["tokens_per_s"] * st
        if _num(st) and st > 0:
            for src, dst in (("comm_wait_s", "comm_wait_share"), ("compute_s", "compute_share")):
                if _num(r.get(src)):
                    r[dst] = r[src] / st
            r["engine_step_s"] = st
        if any_period:
            r.pop("step_time_s", None)
            if period is not None and period > 0:
                r["step_time_s"] = period
        rows.append(r)
    keys: list[str] = []
    for r in rows:
        keys += [k for k, v in r.items() if k not in _NOT_MEASURED and _num(v) and k not in keys]
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(r[k]) for r in rows if _num(r.get(k))]
        if vals:
            out[k] = max(vals) if k == "peak_mem_mb" else statistics.median(vals)
    _consistent_throughput(out)
    out["steps_measured"] = float(len(rows))
    if len(records) <= warmup:
        out["warmup_short"] = 1.0
    return out


_ERR_PATTERNS = [
    re.compile(r"foldtrain: error: .*"),
    re.compile(r"^\s*(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Interrupt)\b:?.*$"),
]
_NOISE = re.compile(
    r"torch\.distributed\.elastic|ChildFailedError|^\s*(?:=+|-+|\[.*\]:?|Root Cause|Failures:|<NO_OTHER_FAILURES>"
    r"|traceback : .*|error_file: .*|exitcode\s*:.*|host\s*:.*|rank\s*:.*|time\s*:.*|local_rank\s*:.*)\s*$"
)


# what launchers put before a child's output lines:
# torch >= 2.5 "[rank1]:", horovodrun "[1]<stderr>:" / "[1,0]<stdout>:"
_CHILD_PREFIX = re.compile(r"^\s*(?:\[(?:rank)?\d+(?:,\d+)?\](?:<std(?:out|err)>)?:[ \t]?)+")
# the launcher's own summary of a child's failure, never the cause
_LAUNCHER_NOISE = re.compile(
    r"Horovod detected that one or more processes exited|^Process \d+ exit with status code"
    r"|^Terminating remaining workers after failure"
)


def error_line(text: str, limit: int = 200) -> str:
    """The most telling line of a failed run's output: a ``foldtrain: error:`` line if any, else the
    last ``...Error: ...`` line that is not the launcher's own failure report (torchrun's, horovodrun's),
    else the last line. Launchers' per-rank prefixes (``[rank1]:``, ``[1]<stderr>:``) are removed."""
    lines = [_CHILD_PREFIX.sub("", line).rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip() and not _LAUNCHER_NOISE.search(line.strip())]
    for pat in _ERR_PATTERNS:
        hits = [line.strip() for line in lines if pat.search(line) and not _NOISE.search(line)]
        hits = [h for h in hits if not h.startswith("torch.distributed.elastic.multiprocessing.errors")]
        if hits:
            return _clip(hits[-1], limit)
    useful = [line.strip() for line in lines if not _NOISE.search(line)]
    return _clip(useful[-1] if useful else (lines[-1].strip() if lines else "failed without output"), limit)


def _clip(s: str, limit: int) -> str:
    return s if len(s) <= limit else s[: limit - 3] + "..."


def merge_repeats(reps: list[RunResult]) -> RunResult:
    """One result from repetitions of the same run: the median over the repetitions that worked of
    each metric (``peak_mem_mb``: the maximum), link bytes averaged; failed only if every one failed
    (otherwise the failures are counted in ``info["note"]``)."""
    if len(reps) == 1:
        return reps[0]
    ok = [r for r in reps if r.ok]
    base = ok[0] if ok else reps[-1]
    out = RunResult(**{**base.__dict__, "info": dict(base.info), "metrics": {}, "wire": None})
    out.info["repeats"] = len(reps)
    out.info["out_dirs"] = [r.out_dir for r in reps]
    if not ok:
        return out
    keys = list(dict.fromkeys(k for r in ok for k in r.metrics))
    for k in keys:
        vals = [r.metrics[k] for r in ok if k in r.metrics]
        out.metrics[k] = (
            max(vals) if k == "peak_mem_mb" else (sum(vals) if k == "steps_measured" else statistics.median(vals))
        )
    _consistent_throughput(out.metrics)
    wires = [r.wire for r in ok if r.wire]
    if wires and all(len(w) == len(wires[0]) for w in wires):
        out.wire = [
            (sum(w[i][0] for w in wires) / len(wires), sum(w[i][1] for w in wires) / len(wires))
            for i in range(len(wires[0]))
        ]
    failed = len(reps) - len(ok)
    if failed:
        note = f"{failed} of {len(reps)} repetitions failed ({[r.error for r in reps if not r.ok][-1]})"
        out.info["note"] = (out.info["note"] + "; " if out.info.get("note") else "") + note
    return out


# ---------------------------------------------------------------- derived columns


def save_results(runs: list[RunResult], path: str | Path) -> None:
    Path(path).write_text(json.dumps([r.to_json() for r in runs], indent=1))


def load_results(path: str | Path) -> list[RunResult]:
    return [RunResult.from_json(d) for d in json.loads(Path(path).read_text())]
