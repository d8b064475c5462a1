"""Pure functions of the benchmark, part two: per-run results -> the study's tables (text and
markdown) and the target ratios, each a number with the two runs it compares."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from foldtrain.bench.results import RunResult


def baseline_for(run: RunResult, runs: Iterable[RunResult]) -> RunResult | None:
    """The single-process reference of a dp run: foldtrain ``none`` at 1 rank, same precision."""
    for r in runs:
        if (
            r.bench == "dp"
            and r.impl == "foldtrain"
            and r.variant == "none"
            and r.ranks == 1
            and r.precision == run.precision
            and r.ok
        ):
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


DP_HEADERS = [
    "strategy",
    "precision",
    "ranks",
    "network",
    "time/step ms",
    "tokens/s",
    "speed-up",
    "efficiency",
    "peak MB/rank",
    "grad+optim MB/rank",
    "MB/step/worker",
    "MB/step server",
    "comm wait",
    "wire MB/step n0/others",
    "note",
]


def dp_rows(runs: list[RunResult]) -> list[list[str]]:
    rows = []
    for r in runs:
        if r.bench != "dp":
            continue
        if not r.ok:
            rows.append([r.label, r.precision, str(r.ranks), r.network, *["—"] * 10, f"FAILED: {r.error}"])
            continue
        m = r.metrics
        w, s, wsrc, ssrc = _bytes(r)
        n0, rest = wire_split(r)
        wire = f"{fmt(n0, 'mb')}/{fmt(rest, 'mb')}" if r.wire else "—"
        note = r.info.get("note", "")
        if m.get("warmup_short"):
            note = (note + "; " if note else "") + "fewer steps than warm-up"
        rows.append(
            [
                r.label,
                r.precision,
                str(r.ranks),
                r.network,
                fmt(m.get("step_time_s"), "ms"),
                fmt(m.get("tokens_per_s"), "int"),
                fmt(speedup(r, runs), "x"),
                fmt(efficiency(r, runs), "pct"),
                fmt(m.get("peak_mem_mb"), "f1"),
                fmt(m.get("grad_optim_mem_mb"), "f1"),
                fmt(w, "mb") + ("*" if wsrc == "links" else ""),
                fmt(s, "mb") + ("*" if ssrc == "links" else ""),
                fmt(m.get("comm_wait_share"), "pct"),
                wire,
                note,
            ]
        )
    return rows


PIPE_HEADERS = [
    "impl",
    "schedule",
    "V",
    "dp_sync",
    "network",
    "time/step ms",
    "tokens/s",
    "all-rank idle",
    "bubble",
    "exposed DP comm ms",
    "peak MB/rank",
    "wire MB/step/node",
    "note",
]


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
        rows.append(
            [
                r.impl,
                r.variant,
                v,
                sync,
                r.network,
                fmt(m.get("step_time_s"), "ms"),
                fmt(m.get("tokens_per_s"), "int"),
                fmt(m.get("all_rank_idle_fraction"), "pct"),
                fmt(m.get("bubble_fraction"), "pct"),
                fmt(m.get("exposed_dp_comm_s"), "ms"),
                fmt(m.get("peak_mem_mb"), "f1"),
                fmt(wire, "mb"),
                r.info.get("note", ""),
            ]
        )
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


def _ratio(
    a: RunResult | None,
    b: RunResult | None,
    key: str = "tokens_per_s",
    names: tuple[str, str] = ("numerator", "denominator"),
) -> tuple[float | None, str]:
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

    * allreduce / ddp_plain, sharded-ps / ddp_plain, fsdp / fsdp_plain and fsdp-root / fsdp_plain tokens/s, per
      network and precision, at the largest rank count both ran;
    * allreduce vs colocated ps tokens/s at 4 ranks (else the largest) on each throttled network;
    * server vs worker bytes per step for ps (largest rank count, per network)."""
    runs = [r for r in runs if r.bench == "dp"]
    networks = list(dict.fromkeys(r.network for r in runs if r.ranks > 1))
    precisions = list(dict.fromkeys(r.precision for r in runs))
    variants = {(r.impl, r.variant) for r in runs}
    out = _dp_vs_ddp_plain(runs, networks, precisions, variants)
    if ("foldtrain", "allreduce") in variants and ("foldtrain", "ps") in variants:
        out += _allreduce_vs_ps(runs, [n for n in networks if n != "loopback"], precisions)
    return out + _ps_server_bytes(runs, networks, precisions)


def _dp_run(runs: list[RunResult], impl: str, variant: str, net: str, prec: str, n: int) -> RunResult | None:
    return _find(runs, impl=impl, variant=variant, network=net, precision=prec, ranks=n)


PLAIN_PAIRS = (
    ("allreduce", "ddp_plain"),
    ("sharded-ps", "ddp_plain"),
    ("fsdp", "fsdp_plain"),
    ("fsdp-root", "fsdp_plain"),
)


def _dp_vs_ddp_plain(runs: list[RunResult], networks: list[str], precisions: list[str], variants: set) -> list[Ratio]:
    """Each strategy against its plain-PyTorch anchor (``PLAIN_PAIRS``), tokens/s at the largest rank count
    both ran."""
    out: list[Ratio] = []
    for net in networks:
        for prec in precisions:
            for strat, plain in PLAIN_PAIRS:
                if ("foldtrain", strat) not in variants or (plain, "") not in variants:
                    continue
                pair = (("foldtrain", strat), (plain, ""))
                ranks = {
                    r.ranks
                    for r in runs
                    if r.network == net and r.precision == prec and r.ranks > 1 and (r.impl, r.variant) in pair
                }
                if not ranks:
                    continue
                n = max(ranks)
                v, why = _ratio(
                    _dp_run(runs, "foldtrain", strat, net, prec, n),
                    _dp_run(runs, plain, "", net, prec, n),
                    names=(strat, plain),
                )
                out.append(Ratio(f"{strat} / {plain} tokens/s [{net}, {prec}, {n} ranks]", v, why))
    return out


def _allreduce_vs_ps(runs: list[RunResult], networks: list[str], precisions: list[str]) -> list[Ratio]:
    """allreduce / ps tokens/s at 4 ranks (else the largest both ran) on each of ``networks``."""
    out: list[Ratio] = []
    for net in networks:
        for prec in precisions:
            ranks = {
                r.ranks
                for r in runs
                if r.network == net
                and r.precision == prec
                and r.impl == "foldtrain"
                and r.variant in ("allreduce", "ps")
            }
            if not ranks:
                continue
            n = 4 if 4 in ranks else max(ranks)
            ps = _dp_run(runs, "foldtrain", "ps", net, prec, n)
            k = int(ps.info.get("ps_servers", 0) or 0) if ps else 0
            kind = f"{k} dedicated server(s)" if k else "colocated"
            allreduce = _dp_run(runs, "foldtrain", "allreduce", net, prec, n)
            v, why = _ratio(allreduce, ps, names=("allreduce", "ps"))
            out.append(Ratio(f"allreduce / ps ({kind}) tokens/s [{net}, {prec}, {n} ranks]", v, why))
    return out


def _ps_server_bytes(runs: list[RunResult], networks: list[str], precisions: list[str]) -> list[Ratio]:
    """The ps server's bytes per step over a worker's, at the largest rank count, per network and precision."""
    out: list[Ratio] = []
    for net in networks:
        for prec in precisions:
            ps_runs = sorted(
                [r for r in runs if is_ps(r) and r.network == net and r.precision == prec and r.ranks > 1],
                key=lambda r: -r.ranks,
            )
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
                why = "workers' bytes unknown on loopback (rank 0 is the server); see the emulated network"
                out.append(Ratio(name, None, why))
            else:
                out.append(Ratio(name, None, "no byte counters logged"))
    return out


def pipeline_ratios(runs: list[RunResult], baseline: str = "interleaved-1f1b") -> list[Ratio]:
    """fold vs the after-flush interleaved baseline (tokens/s, all-rank idle) and vs torch LoopedBFS + DDP."""
    runs = [r for r in runs if r.bench == "pipeline" and not r.info.get("bound_of")]
    out: list[Ratio] = []

    def pick(impl: str, variant: str, net: str, sync: str) -> RunResult | None:
        hits = [
            r
            for r in runs
            if r.impl == impl
            and r.variant == variant
            and r.network == net
            and not r.info.get("defer")
            and not r.info.get("zero")
        ]
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


def report_markdown(
    title: str, headers: list[str], rows: list[list[str]], ratios: list[Ratio], notes: list[str]
) -> str:
    parts = [f"# {title}", "", markdown_table(headers, rows), "", "## Ratios", ""]
    parts += [f"- {r.line()}" for r in ratios] or ["- (none computable)"]
    if notes:
        parts += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(parts) + "\n"
