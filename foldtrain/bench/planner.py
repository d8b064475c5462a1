"""Does ``foldtrain plan``'s first choice measure within 10% of the best layout measured here?

    foldtrain bench planner [--calibration /tmp/ft-simval/calibration.json] [--repeat 3]

Plans the ``tiny`` model (global batch 16 x 128) on 4 ranks of this machine with the cluster
calibrated by ``foldtrain bench simulator`` (as its runs: compute calibrated with a core per
process, the cores shared among the 4 ranks; gloo on loopback), launches the plan's top 4
distinct layouts for a few steps each, ``--repeat`` times in rounds, and writes the result as
the last section of ``docs/simulator.md`` (replacing the previous check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from foldtrain.bench.simulator import cluster_of, load_calibration
from foldtrain.config import to_toml
from foldtrain.sim.plan import plan

ROOT = Path(__file__).resolve().parents[2]  # the repository (docs/ lives there)

BASE = ["--model.preset", "tiny", "--train.global_batch", "16", "--train.seq_len", "128"]
RUN = [
    "--train.log_every",
    "1",
    "--train.eval_every",
    "0",
    "--train.eval_batches",
    "1",
    "--train.sample_tokens",
    "0",
    "--train.progress",
    "false",
    "--checkpoint.every",
    "0",
    "--checkpoint.keep",
    "1",
    "--checkpoint.safetensors",
    "false",
]


def measure(cfg, world: int, steps: int, data: str) -> float:
    d = Path(tempfile.mkdtemp(prefix="ft-plancheck-"))
    (d / "c.toml").write_text(to_toml(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        "-m",
        "foldtrain",
        "train",
        "--config",
        str(d / "c.toml"),
        "--out",
        str(d / "run"),
        "--train.steps",
        str(steps),
        *RUN,
        *(["--data.path", data] if data else []),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{p.stderr[-1500:]}")
    recs = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r and r.get("step", 0) > 3]
    return statistics.median(vals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default="/tmp/ft-simval/calibration.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="launch every layout K times, in rounds, and compare the medians (one launch of a layout moves by "
        "up to +-8%% here, as much as the layouts differ)",
    )
    ap.add_argument("--data", default="")
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    a = ap.parse_args(argv)
    comps, loop, _, cores, _ = load_calibration(Path(a.calibration))
    c = cluster_of(comps, 4, cores, loop[4], None, 4, "this machine, 4 ranks")
    c = dataclasses.replace(c, memory=6e9)
    res = plan(BASE, None, c, 4)
    picks, seen = [], set()
    for cand in res.top:
        if cand.label() not in seen:
            seen.add(cand.label())
            picks.append(cand)
        if len(picks) == 4:
            break
    cfgs = []
    for cand in picks:
        cfg = cand.cfg
        if cand.setup.mode == "dp":  # train runs a strategy with parallel.dp 1 and one process per worker
            cfg.parallel.dp, cfg.parallel.microbatches = 1, 0
        cfgs.append(cfg)
    runs: list[list[float]] = [[] for _ in picks]
    for k in range(a.repeat):  # in rounds, every layout once per round: slow spells of the machine hit all of them
        for i, (cand, cfg) in enumerate(zip(picks, cfgs)):
            runs[i].append(measure(cfg, 4, a.steps, a.data))
            print(
                f"round {k + 1}: {cand.label()} predicted {cand.result.tokens_per_s:,.0f} measured {runs[i][-1]:,.0f}",
                flush=True,
            )
    rows = [(cand, statistics.median(r), r) for cand, r in zip(picks, runs)]
    best = max(t for _, t, _ in rows)
    first = rows[0][1]
    L = [
        "",
        "## Planner check (`foldtrain bench planner`)",
        "",
        "The plan's top 4 distinct layouts for `tiny` (global batch 16 × 128) on 4 ranks of this machine, "
        f"each launched for {a.steps} steps (median tokens/s after step 3), {a.repeat} time(s) in rounds "
        "(measured: the median of the rounds):",
        "",
        "| plan rank | layout | predicted tokens/s | measured tokens/s | each round |",
        "|---|---|---|---|---|",
    ]
    L += [
        f"| {i + 1} | {cand.label()} | {cand.result.tokens_per_s:,.0f} | {t:,.0f} | "
        f"{', '.join(f'{x:,.0f}' for x in r)} |"
        for i, (cand, t, r) in enumerate(rows)
    ]
    L += [
        "",
        f"The plan's first choice measures {first / best:.1%} of the best measured "
        f"({'within' if first >= 0.9 * best else '**not** within'} 10%).",
        "",
    ]
    path = Path(a.docs) / "simulator.md"
    text = path.read_text()
    if "\n## Planner check" in text:  # replace the previous check (and the notes under it), keep the rest
        text = text[: text.index("\n## Planner check")]
    path.write_text(text.rstrip("\n") + "\n" + "\n".join(L))
    print("\n".join(L))
    return 0
