"""Pure functions of the benchmark: metrics.jsonl -> per-run medians -> tables and target ratios.

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
from typing import Any, Iterable

# keys of a metrics.jsonl record that are not per-step measurements
_NOT_MEASURED = {"step", "loss", "lr", "grad_norm", "val_loss", "val_ppl"}


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
    def from_json(cls, d: dict) -> "RunResult":
        d = dict(d)
        if d.get("wire") is not None:
            d["wire"] = [tuple(x) for x in d["wire"]]
        return cls(**d)


# ---------------------------------------------------------------- reading runs


def read_metrics(path: str | Path) -> list[dict]:
    """The per-step records of a metrics.jsonl (lines that are not JSON objects are skipped)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    out = []
    if not p.is_file():
        return out
    for line in p.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step_time_s" in rec:
            out.append(rec)
    return out


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _consistent_throughput(m: dict[str, float]) -> None:
    """tokens/s = tokens per step / the median step time (so the two columns always agree, also
    when a median falls between two steps or between repetitions)."""
    if m.get("tokens_per_step") and m.get("step_time_s"):
        m["tokens_per_s"] = m["tokens_per_step"] / m["step_time_s"]


def summarize_records(records: list[dict], warmup: int = 3) -> dict[str, float]:
    """Medians of every numeric per-step measurement after the first ``warmup`` records.

    ``peak_mem_mb`` is the maximum (it is a high-water mark). Derived per step before the median:
    ``comm_bytes`` (sent + received), ``comm_wait_share`` (comm_wait_s / step_time_s) and
    ``compute_share``. ``steps_measured`` says how many records the medians use. If there are no
    more than ``warmup`` records, the last one is used (and ``warmup_short`` is set)."""
    if not records:
        return {}
    kept = records[warmup:] if len(records) > warmup else records[-1:]
    rows = []
    for r in kept:
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
_NOISE = re.compile(r"torch\.distributed\.elastic|ChildFailedError|^\s*(?:=+|-+|\[.*\]:?|Root Cause|Failures:|<NO_OTHER_FAILURES>|traceback : .*|error_file: .*|exitcode\s*:.*|host\s*:.*|rank\s*:.*|time\s*:.*|local_rank\s*:.*)\s*$")


# what launchers put before a child's output lines: torch >= 2.5 "[rank1]:", horovodrun "[1]<stderr>:" / "[1,0]<stdout>:"
_CHILD_PREFIX = re.compile(r"^\s*(?:\[(?:rank)?\d+(?:,\d+)?\](?:<std(?:out|err)>)?:[ \t]?)+")
# the launcher's own summary of a child's failure, never the cause
_LAUNCHER_NOISE = re.compile(r"Horovod detected that one or more processes exited|^Process \d+ exit with status code|^Terminating remaining workers after failure")


def error_line(text: str, limit: int = 200) -> str:
    """The most telling line of a failed run's output: a ``foldtrain: error:`` line if any, else the
    last ``...Error: ...`` line that is not the launcher's own failure report (torchrun's, horovodrun's),
    else the last line. Launchers' per-rank prefixes (``[rank1]:``, ``[1]<stderr>:``) are removed."""
    lines = [_CHILD_PREFIX.sub("", l).rstrip() for l in text.splitlines()]
    lines = [l for l in lines if l.strip() and not _LAUNCHER_NOISE.search(l.strip())]
    for pat in _ERR_PATTERNS:
        hits = [l.strip() for l in lines if pat.search(l) and not _NOISE.search(l)]
        hits = [h for h in hits if not h.startswith("torch.distributed.elastic.multiprocessing.errors")]
        if hits:
            return _clip(hits[-1], limit)
    useful = [l.strip() for l in lines if not _NOISE.search(l)]
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
        out.metrics[k] = max(vals) if k == "peak_mem_mb" else (sum(vals) if k == "steps_measured" else statistics.median(vals))
    _consistent_throughput(out.metrics)
    wires = [r.wire for r in ok if r.wire]
    if wires and all(len(w) == len(wires[0]) for w in wires):
        out.wire = [(sum(w[i][0] for w in wires) / len(wires), sum(w[i][1] for w in wires) / len(wires)) for i in range(len(wires[0]))]
    failed = len(reps) - len(ok)
    if failed:
        note = f"{failed} of {len(reps)} repetitions failed ({[r.error for r in reps if not r.ok][-1]})"
        out.info["note"] = (out.info["note"] + "; " if out.info.get("note") else "") + note
    return out


# ---------------------------------------------------------------- derived columns


def baseline_for(run: RunResult, runs: Iterable[RunResult]) -> RunResult | None:
    """The single-process reference of a dp run: foldtrain ``none`` at 1 rank, same precision."""
    for r in runs:
        if r.bench == "dp" and r.impl == "foldtrain" and r.variant == "none" and r.ranks == 1 and r.precision == run.precision and r.ok:
            return r
    return None


def speedup(run: RunResult, runs: Iterable[RunResult]) -> float | None:
    base = baseline_for(run, list(runs))
    if not run.ok or base is None:
        return None
    a, b = run.metrics.get("tokens_per_s"), base.metrics.get("tokens_per_s")
    return a / b if a and b else None


def efficiency(run: RunResult, runs: Iterable[RunResult]) -> float | None:
    s = speedup(run, runs)
    return s / max(run.workers, 1) if s is not None else None


def is_ps(run: RunResult) -> bool:
    return run.impl == "foldtrain" and run.variant == "ps"


def bytes_per_step(run: RunResult) -> tuple[float | None, float | None, str]:
    """(per worker, at the server, source) bytes sent + received per step.

    From the strategy's own counters (rank 0 logs them): rank 0 is a worker for every strategy
    except ``ps``, where rank 0 is the (colocated or first dedicated) server. Explicit
    ``worker_comm_bytes`` / ``server_comm_bytes`` keys win when a strategy logs them. On the
    emulated network the link counters fill what the counters do not say (for ``ps`` the workers'
    bytes are the mean over the other nodes). ``source`` is "counters", "links" or "counters+links"
    ("" when nothing is known); the server value is None for strategies without a server."""
    w, s, ws, ss = _bytes(run)
    return w, s, "+".join(dict.fromkeys(x for x in (ss, ws) if x))


def _bytes(run: RunResult) -> tuple[float | None, float | None, str, str]:
    """(worker bytes, server bytes, worker source, server source)."""
    m = run.metrics
    worker, server = m.get("worker_comm_bytes"), m.get("server_comm_bytes")
    rank0 = m.get("comm_bytes")
    if not is_ps(run):
        if worker is None:
            worker = rank0
        if worker is not None:
            return worker, None, "counters", ""
        if run.wire:
            return sum(s + r for s, r in run.wire) / len(run.wire), None, "links", ""
        return None, None, "", ""
    ws = ss = ""
    if server is None:
        server = rank0
    if server is not None:
        ss = "counters"
    elif run.wire:
        server, ss = sum(run.wire[0]), "links"
    if worker is not None:
        ws = "counters"
    elif run.wire and len(run.wire) > 1:
        others = run.wire[max(1, int(run.info.get("ps_servers", 0) or 0)) :]  # ranks 0..K-1 serve, one per node
        if others:
            worker, ws = sum(s + r for s, r in others) / len(others), "links"
    return worker, server, ws, ss


def wire_split(run: RunResult) -> tuple[float | None, float | None]:
    """(node 0, mean of the other nodes) link bytes per step on the emulated network."""
    if not run.wire:
        return None, None
    n0 = sum(run.wire[0])
    rest = run.wire[1:]
    return n0, (sum(s + r for s, r in rest) / len(rest) if rest else None)


# ---------------------------------------------------------------- formatting


def fmt(v: Any, kind: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if kind == "ms":
        return f"{v * 1e3:.1f}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "mb":
        return f"{v / 1e6:.2f}" if v >= 5e4 or v == 0 else f"{v / 1e6:.4f}"
    if kind == "int":
        return f"{v:,.0f}"
    if kind == "f1":
        return f"{v:.1f}"
    return str(v)


DP_HEADERS = ["strategy", "precision", "ranks", "network", "time/step ms", "tokens/s", "speed-up", "efficiency",
              "peak MB/rank", "MB/step/worker", "MB/step server", "comm wait", "wire MB/step n0/others", "note"]


def dp_rows(runs: list[RunResult]) -> list[list[str]]:
    rows = []
    for r in runs:
        if r.bench != "dp":
            continue
        if not r.ok:
            rows.append([r.label, r.precision, str(r.ranks), r.network, *["—"] * 9, f"FAILED: {r.error}"])
            continue
        m = r.metrics
        w, s, wsrc, ssrc = _bytes(r)
        n0, rest = wire_split(r)
        wire = f"{fmt(n0, 'mb')}/{fmt(rest, 'mb')}" if r.wire else "—"
        note = r.info.get("note", "")
        if m.get("warmup_short"):
            note = (note + "; " if note else "") + "fewer steps than warm-up"
        rows.append([
            r.label, r.precision, str(r.ranks), r.network,
            fmt(m.get("step_time_s"), "ms"), fmt(m.get("tokens_per_s"), "int"),
            fmt(speedup(r, runs), "x"), fmt(efficiency(r, runs), "pct"),
            fmt(m.get("peak_mem_mb"), "f1"), fmt(w, "mb") + ("*" if wsrc == "links" else ""),
            fmt(s, "mb") + ("*" if ssrc == "links" else ""),
            fmt(m.get("comm_wait_share"), "pct"), wire, note,
        ])
    return rows


PIPE_HEADERS = ["impl", "schedule", "V", "dp_sync", "network", "time/step ms", "tokens/s", "all-rank idle", "bubble",
                "exposed DP comm ms", "peak MB/rank", "wire MB/step/node", "note"]


def pipeline_rows(runs: list[RunResult]) -> list[list[str]]:
    rows = []
    for r in runs:
        if r.bench != "pipeline":
            continue
        v, sync = str(r.info.get("virtual", "—")), str(r.info.get("dp_sync", "—"))
        if not r.ok:
            rows.append([r.impl, r.variant, v, sync, r.network, *["—"] * 7, f"FAILED: {r.error}"])
            continue
        m = r.metrics
        wire = (sum(s + x for s, x in r.wire) / len(r.wire)) if r.wire else None
        rows.append([
            r.impl, r.variant, v, sync, r.network, fmt(m.get("step_time_s"), "ms"), fmt(m.get("tokens_per_s"), "int"),
            fmt(m.get("all_rank_idle_fraction"), "pct"), fmt(m.get("bubble_fraction"), "pct"),
            fmt(m.get("exposed_dp_comm_s"), "ms"), fmt(m.get("peak_mem_mb"), "f1"), fmt(wire, "mb"), r.info.get("note", ""),
        ])
    return rows


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """Aligned plain-text table (numbers right-aligned; the last column left as is)."""
    if not rows:
        return "(no runs)"
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    last = len(headers) - 1

    def line(cells):
        out = []
        for i, (c, w) in enumerate(zip(cells, widths)):
            c = str(c)
            if i == last:
                out.append(c)
            elif i < 4 or not _looks_numeric(c):
                out.append(c.ljust(w))
            else:
                out.append(c.rjust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths[:last]) + "  " + "-" * max(4, len(headers[last]))
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _looks_numeric(s: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d,.]+[x%*]?|—|[\d.]+/[\d.—]+", s))


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def esc(c: Any) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------- target ratios


@dataclass
class Ratio:
    name: str
    value: float | None
    detail: str = ""  # what was compared, or why there is no value

    def line(self) -> str:
        v = f"{self.value:.3f}" if self.value is not None else "n/a"
        return f"{self.name}: {v}" + (f"  ({self.detail})" if self.detail else "")


def _find(runs: list[RunResult], **want) -> RunResult | None:
    for r in runs:
        if all(getattr(r, k) == v for k, v in want.items()):
            return r
    return None


def _ratio(a: RunResult | None, b: RunResult | None, key: str = "tokens_per_s", names: tuple[str, str] = ("numerator", "denominator")) -> tuple[float | None, str]:
    if a is None or b is None:
        missing = " and ".join(x for x, r in zip(names, (a, b)) if r is None)
        return None, f"{missing} not run"
    if not a.ok or not b.ok:
        bad = [r.label for r in (a, b) if not r.ok]
        return None, f"{', '.join(bad)} failed"
    x, y = a.metrics.get(key), b.metrics.get(key)
    if x is None or y is None or y == 0:
        return None, f"no {key} logged"
    return x / y, ""


def dp_ratios(runs: list[RunResult]) -> list[Ratio]:
    """The study's target ratios, each from runs of this same benchmark invocation.

    * allreduce / ddp_plain and sharded-ps / ddp_plain tokens/s, per network and precision, at the
      largest rank count both ran;
    * allreduce vs colocated ps tokens/s at 4 ranks (else the largest) on each throttled network;
    * server vs worker bytes per step for ps (largest rank count, per network)."""
    runs = [r for r in runs if r.bench == "dp"]
    out: list[Ratio] = []
    networks = list(dict.fromkeys(r.network for r in runs if r.ranks > 1))
    precisions = list(dict.fromkeys(r.precision for r in runs))
    variants = {(r.impl, r.variant) for r in runs}

    def get(impl: str, variant: str, net: str, prec: str, n: int) -> RunResult | None:
        return _find(runs, impl=impl, variant=variant, network=net, precision=prec, ranks=n)

    for net in networks:
        for prec in precisions:
            for strat in ("allreduce", "sharded-ps"):
                if ("foldtrain", strat) not in variants or ("ddp_plain", "") not in variants:
                    continue
                ranks = sorted({r.ranks for r in runs if r.network == net and r.precision == prec and r.ranks > 1
                                and (r.impl, r.variant) in (("foldtrain", strat), ("ddp_plain", ""))}, reverse=True)
                if not ranks:
                    continue
                n = ranks[0]
                v, why = _ratio(get("foldtrain", strat, net, prec, n), get("ddp_plain", "", net, prec, n), names=(strat, "ddp_plain"))
                out.append(Ratio(f"{strat} / ddp_plain tokens/s [{net}, {prec}, {n} ranks]", v, why))
    if ("foldtrain", "allreduce") in variants and ("foldtrain", "ps") in variants:
        for net in [n for n in networks if n != "loopback"]:
            for prec in precisions:
                ranks = sorted({r.ranks for r in runs if r.network == net and r.precision == prec and r.impl == "foldtrain"
                                and r.variant in ("allreduce", "ps")}, reverse=True)
                if not ranks:
                    continue
                n = 4 if 4 in ranks else ranks[0]
                ps = get("foldtrain", "ps", net, prec, n)
                k = int(ps.info.get("ps_servers", 0) or 0) if ps else 0
                kind = f"{k} dedicated server(s)" if k else "colocated"
                v, why = _ratio(get("foldtrain", "allreduce", net, prec, n), ps, names=("allreduce", "ps"))
                out.append(Ratio(f"allreduce / ps ({kind}) tokens/s [{net}, {prec}, {n} ranks]", v, why))
    for net in networks:
        for prec in precisions:
            ps_runs = sorted([r for r in runs if is_ps(r) and r.network == net and r.precision == prec and r.ranks > 1],
                             key=lambda r: -r.ranks)
            if not ps_runs:
                continue
            r = ps_runs[0]
            name = f"ps server / worker bytes per step [{net}, {prec}, {r.ranks} ranks]"
            if not r.ok:
                out.append(Ratio(name, None, "ps failed"))
                continue
            w, s, src = bytes_per_step(r)
            if w and s is not None:
                out.append(Ratio(name, s / w, f"{fmt(s, 'mb')} MB vs {fmt(w, 'mb')} MB per step, from {src}"))
            elif s is not None:
                out.append(Ratio(name, None, "workers' bytes unknown on loopback (rank 0 is the server); see the emulated network"))
            else:
                out.append(Ratio(name, None, "no byte counters logged"))
    return out


def pipeline_ratios(runs: list[RunResult], baseline: str = "interleaved-1f1b") -> list[Ratio]:
    """fold vs the after-flush interleaved baseline (tokens/s, all-rank idle) and vs torch LoopedBFS + DDP."""
    runs = [r for r in runs if r.bench == "pipeline"]
    out: list[Ratio] = []
    def pick(impl: str, variant: str, net: str, sync: str) -> RunResult | None:
        hits = [r for r in runs if r.impl == impl and r.variant == variant and r.network == net and not r.info.get("defer")]
        return next((r for r in hits if r.info.get("dp_sync") == sync), hits[0] if hits else None)

    for net in dict.fromkeys(r.network for r in runs):
        fold = pick("foldtrain", "fold", net, "per-chunk")
        base = pick("foldtrain", baseline, net, "after-flush")
        v, why = _ratio(fold, base, names=("fold", baseline))
        out.append(Ratio(f"fold / {baseline} (after-flush) tokens/s [{net}]", v, why))
        v, why = _ratio(fold, base, "all_rank_idle_fraction", names=("fold", baseline))
        out.append(Ratio(f"fold / {baseline} all-rank idle fraction [{net}]", v, why))
        bfs = pick("torch", "looped-bfs", net, "after-flush")
        v, why = _ratio(fold, bfs, names=("fold", "torch looped-bfs"))
        out.append(Ratio(f"fold / torch LoopedBFS+DDP tokens/s [{net}]", v, why))
    return out


def save_results(runs: list[RunResult], path: str | Path) -> None:
    Path(path).write_text(json.dumps([r.to_json() for r in runs], indent=1))


def load_results(path: str | Path) -> list[RunResult]:
    return [RunResult.from_json(d) for d in json.loads(Path(path).read_text())]


def report_markdown(title: str, headers: list[str], rows: list[list[str]], ratios: list[Ratio], notes: list[str]) -> str:
    parts = [f"# {title}", "", markdown_table(headers, rows), "", "## Ratios", ""]
    parts += [f"- {r.line()}" for r in ratios] or ["- (none computable)"]
    if notes:
        parts += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(parts) + "\n"
