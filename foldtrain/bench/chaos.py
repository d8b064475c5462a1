"""``foldtrain bench chaos``: ranks killed with SIGKILL at random moments under ``torchrun --max-restarts``,
and nothing lost.

    foldtrain bench chaos [--kills 6] [--steps 24] [--every 4] [--seed 0] [--layouts ddp,...] [--no_node_loss]

For each layout, one uninterrupted reference run and one chaos run of the same config: under
``torchrun --max-restarts K``, ``K`` kills (one per attempt) of a seeded random rank at a seeded random
step, at a random point among ``forward``, ``backward``, ``reduce`` (a collective) and ``save``
(:mod:`foldtrain.faults` strikes). Every attempt resumes from the newest intact checkpoint. A row says
whether the chaos run's final parameters equal the reference's bit for bit and whether its
``metrics.jsonl`` holds every step exactly once, with the kills survived, the steps recomputed (steps
begun in all attempts minus the steps of the run) and the wall time. With root and iproute2, one more
row: a 2 nodes x 2 ranks run on the emulated cluster (:mod:`foldtrain.netem`, one torchrun per node)
that loses all ranks of node 1 at once. The table is printed and written to ``--out``/chaos.md and
chaos.json. ``tests/faults/test_chaos.py`` runs the same code at small size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

POINTS = ("forward", "backward", "reduce", "save")
_PP = ["--parallel.pp", "2", "--train.micro_batch", "2"]
LAYOUTS = {
    "ddp": (2, ["--dp.strategy", "ddp"]),
    "sharded-ps": (2, ["--dp.strategy", "sharded-ps"]),
    "dp2xpp2-fold-defer": (
        4,
        [
            *_PP,
            "--parallel.dp",
            "2",
            "--parallel.virtual",
            "2",
            "--parallel.schedule",
            "fold",
            "--parallel.dp_sync",
            "per-chunk",
            "--fold.defer_reduce",
            "true",
            "--optim.grad_clip",
            "0",
        ],
    ),
    "pp2xtp2": (4, [*_PP, "--parallel.tp", "2"]),
}
# the emulated-cluster row: 2 nodes x 2 ranks, foldtrain's all-reduce with size-only buckets. Over more than
# two ranks gloo's ring sums an element in an order that depends on where it sits in its bucket, so bucket
# boundaries set by timing (--dp.cycle_ms) make two runs differ in rounding (torch DDP's 4-rank run differs
# too, its buckets are rebuilt in each attempt); with 2 ranks the sum of two terms is the same in either order.
NODE_LOSS = "node-loss-2x2-allreduce"
NODE_ARGS = ["--dp.strategy", "allreduce", "--dp.cycle_ms", "0"]
TINY = ["--model.preset", "tiny", "--model.n_layer", "4", "--model.d_model", "32", "--model.n_head", "2"]
TINY += ["--model.context", "32", "--model.vocab_size", "512", "--train.seq_len", "16", "--train.global_batch", "8"]
TINY += ["--train.eval_every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0"]
TINY += ["--train.progress", "false", "--optim.warmup_steps", "2", "--train.device", "cpu", "--dp.timeout_s", "20"]


@dataclass(frozen=True)
class Kill:
    attempt: int
    rank: int
    step: int  # the step whose start arms the fault
    point: str

    def spec(self) -> str:
        return f"{self.attempt}:{self.rank}:{self.step}:{self.point}"


def strike_step(k: Kill, steps: int, every: int) -> int:
    """The step during which ``k`` kills: a ``save`` fault waits for the next save (every ``every`` and the last)."""
    if k.point == "save":
        return min(-(-k.step // every) * every, steps)
    return k.step


def resume_step(k: Kill, steps: int, every: int) -> int:
    """The step the attempt after ``k`` resumes from: the last checkpoint completed before the kill."""
    return (strike_step(k, steps, every) - 1) // every * every


def plan_kills(
    seed: int, kills: int, world: int, steps: int, every: int, points=POINTS, ranks: list[int] | None = None
) -> list[Kill]:
    """``kills`` faults, one per attempt, each at a step the attempt reaches (after the step it resumes from)."""
    rng = random.Random(seed)
    out, start = [], 0
    for attempt in range(kills):
        k = Kill(attempt, rng.choice(ranks or range(world)), rng.randint(start + 1, steps), rng.choice(points))
        out.append(k)
        start = resume_step(k, steps, every)
    return out


def fault_env(kills: list[Kill], node_ranks: list[int] | None = None) -> str:
    """``FOLDTRAIN_FAULT`` for ``kills``; with ``node_ranks``, each kill strikes all those ranks at once."""
    parts = []
    for k in kills:
        parts += [Kill(k.attempt, r, k.step, k.point).spec() for r in (node_ranks or [k.rank])]
    return ";".join(parts)


def run_args(data: str, out: Path, layout: str, steps: int, every: int) -> list[str]:
    return [
        *TINY,
        *(NODE_ARGS if layout == NODE_LOSS else LAYOUTS[layout][1]),
        "--train.steps",
        str(steps),
        "--checkpoint.every",
        str(every),
        "--checkpoint.keep",
        "3",
        "--data.path",
        str(data),
        "--out",
        str(out),
    ]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the launcher (the tests fork their ranks instead)


def launch(world: int, args: list[str], fault: str = "", restarts: int = 0, timeout_s: float = 600):
    """``torchrun --standalone --max-restarts`` of ``foldtrain train ARGS``: (exit code, output, wall seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "FOLDTRAIN_FAULT"))}
    root = str(Path(__file__).resolve().parents[2])
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    if fault:
        env["FOLDTRAIN_FAULT"] = fault
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(world), "--max-restarts", str(restarts)]
    cmd += ["-m", "foldtrain", "train", *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=root)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def attempt_starts(out: Path) -> list[int]:
    """The step each attempt started from, read from ``train.log`` (0 for the first attempt)."""
    starts = [0]
    for line in (out / "train.log").read_text().splitlines():
        m = re.search(r"\] restart \d+: .*?(?:step_(\d+)|starting over)", line)
        if m:
            starts.append(int(m.group(1) or 0))
    return starts


def params_equal(out: Path, ref: Path) -> bool:
    """The exported final parameters of two runs are equal bit for bit."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def verify(out: Path, ref: Path, kills: list[Kill], steps: int, every: int, rc: int, text: str) -> dict:
    """One table row's figures for a finished chaos run (``ok`` when every kill struck where planned and nothing
    was lost or repeated)."""
    killed = text.count("exitcode: -9")  # torchrun's report of each SIGKILLed worker
    row = {"kills": len(kills), "killed_workers": killed, "rc": rc}
    if rc != 0 or not (out / "model.safetensors").is_file():
        return {**row, "ok": False, "error": text.strip().splitlines()[-1:] or ["no output"]}
    starts = attempt_starts(out)
    planned = [0, *(resume_step(k, steps, every) for k in kills)]
    ends = [strike_step(k, steps, every) for k in kills] + [steps]
    row.update(
        survived=len(starts) - 1,
        starts=starts,
        planned_starts=planned,
        recomputed=sum(e - s for s, e in zip(starts, ends)) - steps,
        params_equal=params_equal(out, ref),
        steps_once=metrics_steps(out) == list(range(1, steps + 1)),
    )
    row["ok"] = row["params_equal"] and row["steps_once"] and starts == planned and killed == len(kills)
    return row


def chaos_layout(layout: str, data: str, root: Path, kills: int, steps: int, every: int, seed: int) -> dict:
    """The reference and the chaos run of one loopback layout; its table row."""
    world = LAYOUTS[layout][0]
    ref, out = root / f"{layout}-ref", root / f"{layout}-chaos"
    rc, text, _ = launch(world, run_args(data, ref, layout, steps, every))
    if rc != 0:
        return {"layout": layout, "ok": False, "error": f"reference failed: {text.strip().splitlines()[-1:]}"}
    plan = plan_kills(seed, kills, world, steps, every)
    rc, text, wall = launch(world, run_args(data, out, layout, steps, every), fault_env(plan), restarts=kills)
    row = verify(out, ref, plan, steps, every, rc, text)
    return {"layout": layout, **row, "faults": fault_env(plan), "wall_s": round(wall, 1)}


def chaos_node_loss(data: str, root: Path, kills: int, steps: int, every: int, seed: int) -> dict:
    """2 emulated nodes x 2 ranks (one torchrun each): every kill takes all ranks of node 1 at once."""
    from foldtrain.netem.cluster import EmulatedCluster

    ref, out = root / f"{NODE_LOSS}-ref", root / f"{NODE_LOSS}-chaos"
    plan = plan_kills(seed, kills, 4, steps, every, points=("step", "forward", "backward", "reduce", "save"))
    args = ["-m", "foldtrain", "train", *run_args(data, ref, NODE_LOSS, steps, every)[:-1]]
    rows = {}
    with EmulatedCluster(2, "1gbit", name_prefix="ftchaos") as c:
        for name, path, fault, k in ((ref.name, ref, "", 0), (out.name, out, fault_env(plan, [2, 3]), kills)):
            t0 = time.monotonic()
            res = c.run_torchrun(
                ["--max-restarts", str(k), *args, str(path)],
                nproc_per_node=2,
                env={"FOLDTRAIN_FAULT": fault, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                timeout_s=900,
                log_dir=path.parent / f"{name}-launch",
            )
            rows[name] = (0 if res.ok else 1, res.text(), time.monotonic() - t0)
    if rows[ref.name][0] != 0:
        return {"layout": NODE_LOSS, "ok": False, "error": "reference failed: " + rows[ref.name][1][-300:]}
    rc, text, wall = rows[out.name]
    row = verify(out, ref, plan, steps, every, rc, text)  # torchrun reports the first killed worker of a node
    return {"layout": NODE_LOSS, **row, "faults": fault_env(plan, [2, 3]), "wall_s": round(wall, 1)}


def table(rows: list[dict]) -> str:
    head = "| layout | kills survived | steps recomputed | final parameters equal | metrics steps once | wall s |"
    lines = [head, "|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no", None: "-"}
    for r in rows:
        survived = f"{r.get('survived', '-')}/{r.get('kills', '-')}"
        eq, once = yes[r.get("params_equal")], yes[r.get("steps_once")]
        note = f" ({r['error']})" if r.get("error") else ""
        figures = [f"{r['layout']}{note}", survived, r.get("recomputed", "-"), eq, once, r.get("wall_s", "-")]
        lines.append("| " + " | ".join(map(str, figures)) + " |")
    return "\n".join(lines)


def prepare_data(root: Path) -> str:
    """A small prepared dataset (vocabulary 512) from real text, as the tests' fixture builds it."""
    import shutil

    from foldtrain.data import default_corpus_files, prepare

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(default_corpus_files(limit=40)):
        shutil.copy(f, corpus / f"{i:03d}_{f.name}")
    prepare(corpus, root / "data", vocab_size=512, val_fraction=0.1, seed=0, quiet=True)
    return str(root / "data")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="foldtrain bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=6, help="kills per layout (torchrun --max-restarts)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="--checkpoint.every")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--no_node_loss", action="store_true", help="skip the emulated-cluster node loss")
    ap.add_argument("--out", default=None, help="where runs and the table go (default: a temporary directory)")
    a = ap.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or a.kills < 1 or a.every < 1 or a.steps < a.every:
        bad = f"unknown layout {unknown[0]} (choose from {', '.join(LAYOUTS)})" if unknown else "bad sizes"
        print(f"foldtrain bench chaos: {bad}; need --kills >= 1 and --steps >= --every >= 1", file=sys.stderr)
        return 2
    root = Path(a.out or tempfile.mkdtemp(prefix="ft-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    data = prepare_data(root)
    rows = []
    for i, layout in enumerate(layouts):
        rows.append(chaos_layout(layout, data, root, a.kills, a.steps, a.every, a.seed + i))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not a.no_node_loss:
        from foldtrain.errors import FoldtrainError

        try:
            rows.append(chaos_node_loss(data, root, a.kills, a.steps, a.every, a.seed + len(layouts)))
        except FoldtrainError as e:
            print(f"node loss skipped: {e}", file=sys.stderr)
    md = table(rows)
    print(md)
    (root / "chaos.md").write_text(md + "\n")
    (root / "chaos.json").write_text(json.dumps(rows, indent=1))
    print(f"written: {root / 'chaos.md'}, {root / 'chaos.json'}")
    return 0 if all(r.get("ok") for r in rows) else 1
