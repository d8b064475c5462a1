"""The simulator against published GPU training runs of other systems: ``python -m foldtrain.sim.validation.gpu``.

Each run of ``gpu_runs.toml`` is simulated from its configuration as published (model, layout, batch,
precision, recomputation, attention kernel, the nodes' network) on the preset of its GPU, and its predicted
throughput is compared with the published one. Nothing here is fitted: the presets' constants come from
datasheets and microbenchmarks (``microbenchmarks.toml``, cited in each preset), and the doc lists which
source set which constant. Writes ``docs/validation-gpu.md`` (``--out`` changes the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from foldtrain.config import build_config
from foldtrain.config.load import tomllib
from foldtrain.errors import ConfigError
from foldtrain.model.presets import train_flops_per_token

from ..cluster import PRESET_DIR, Cluster, load_cluster
from ..setup import resolve_setup
from ..simulate import Result, simulate_setup
from . import spearman

RUNS = Path(__file__).with_name("gpu_runs.toml")
CMD = "python -m foldtrain.sim.validation.gpu"
# the GPU as published -> (preset, device memory GB)
GPUS = {
    "a100-40gb": ("dgx-a100-40gb", 40.0),
    "a100-80gb": ("dgx-a100", 80.0),
    "h100-80gb-sxm": ("dgx-h100", 80.0),
    "h800": ("dgx-h100", 80.0),
}


def load_runs(path: Path = RUNS) -> list[dict]:
    with open(path, "rb") as f:
        return tomllib.load(f)["run"]


def flops_per_token(run: dict, formula: str) -> float:
    """Model FLOPs per token by the formula a source counts with: ``megatron`` (Narayanan et al.: forward,
    backward and a full recomputation, ``96 l h^2 (1 + s/6h + V/16lh)`` per token), ``megatron-mfu``
    (Korthikanti et al.'s model FLOPs, no recomputation: ``72 l h^2 (1 + s/6h + V/12lh)``), ``6n`` (6 x
    parameters) or ``palm`` (6 x parameters + ``12 l h s``, what ``foldtrain simulate`` reports as MFU)."""
    n, h, s, v = run["n_layer"], run["d_model"], run["seq"], run["vocab"]
    params = n * (12 * h * h + 13 * h) + v * h + s * h
    per = {
        "megatron": 96 * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)),
        "megatron-mfu": 72 * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)),
        "6n": 6 * params,
        "palm": train_flops_per_token(params, n, s, h),
    }
    if formula not in per:
        raise ConfigError(f"gpu_runs.toml {run['id']}: flops_formula {formula!r} unknown; use one of {sorted(per)}")
    return per[formula]


def published_tokens_per_gpu(run: dict) -> float:
    """The published throughput as tokens/s per GPU, converted with the source's own FLOP count."""
    metric, value, gpus = run["metric"], float(run["value"]), run["gpus"]
    tokens_per_step = run["global_batch"] * run["seq"]
    if metric == "tokens_per_s_per_gpu":
        return value
    if metric == "tokens_per_s":
        return value / gpus
    if metric == "iteration_s":
        return tokens_per_step / value / gpus
    if metric == "model_tflops_per_gpu":
        return value * 1e12 / flops_per_token(run, run["flops_formula"])
    if metric == "mfu":
        peak = load_cluster(GPUS[run["gpu"]][0]).peak(run["precision"])
        return value * peak / flops_per_token(run, run["flops_formula"])
    raise ConfigError(f"gpu_runs.toml {run['id']}: metric {metric!r} unknown")


def cluster_for(run: dict) -> Cluster:
    """The run's GPU preset with the run's node as published: GPUs per node, device memory, and the network
    (``inter_gbs``: the node's NICs added up, GB/s per direction; ``intra_gbs``: NVLink per GPU)."""
    preset, memory = GPUS[run["gpu"]]
    c = load_cluster(preset)
    inter = dataclasses.replace(c.inter, bw=run["inter_gbs"] * 1e9) if "inter_gbs" in run else c.inter
    intra = dataclasses.replace(c.intra, bw=run["intra_gbs"] * 1e9) if "intra_gbs" in run else c.intra
    return dataclasses.replace(c, gpus_per_node=run["gpus_per_node"], memory=memory * 1e9, inter=inter, intra=intra)


# a published data-parallel strategy -> the one the simulator models: FSDP's full sharding (foldtrain's fsdp),
# ZeRO-1 as DDP's overlapped all-reduce (the sharded optimizer step is not modelled)
DP_STRATEGIES = {"fsdp-full-shard": "fsdp", "ddp-zero1": "ddp"}
# FSDP's mixed precision as LLM Foundry publishes it (its "MP Mode" column) -> foldtrain's precision: "PURE"
# gathers and computes in bf16 (bf16-master); "DEFAULT" runs bf16 autocast over fp32 parameters, gathered in
# fp32 (foldtrain's fsdp under bf16; DEFAULT's bf16 reduce-scatter is priced as foldtrain's fp32 one, twice its
# bytes: an upper bound, mostly hidden behind the backward). Neither: the run's precision with fp32 masters.
FSDP_PRECISION = {"PURE": "bf16-master", "DEFAULT": "bf16"}


# FSDP1's BackwardPrefetch as a run's configuration sets it -> when the simulator issues a unit's backward
# all-gather (Setup.backward_prefetch): BACKWARD_PRE as the unit after it starts its backward (as FSDP2 does),
# BACKWARD_POST once that unit's backward is done, so the compute waits for it
BACKWARD_PREFETCH = {"BACKWARD_PRE": "pre", "BACKWARD_POST": "post"}


# a published fused-attention kernel -> its speed relative to FlashAttention-2, whose figures the presets hold:
# MPT's Triton FlashAttention (Tri Dao's flash_attn_triton.py: "Triton forward + backward is slightly slower
# than CUDA [FlashAttention] forward + backward"), and FlashAttention-2 "around 2x" FlashAttention
# (microbenchmarks.toml: attention-triton-vs-fa1, a100-attention-fa2-peak)
ATTENTION_SPEED = {"flash": 1.0, "triton": 0.5}


def autocast(run: dict) -> bool:
    """Whether the run computes under autocast over fp32 weights (no half-precision weight copy)."""
    return run.get("fsdp_mixed_precision") == "DEFAULT"


def run_args(run: dict) -> list[str]:
    """``foldtrain simulate`` options of the run's model and layout."""
    args = {
        "model.n_layer": run["n_layer"],
        "model.d_model": run["d_model"],
        "model.n_head": run["n_head"],
        "model.context": run["seq"],
        "model.vocab_size": run["vocab"],
        "train.seq_len": run["seq"],
        "train.global_batch": run["global_batch"],
        "train.micro_batch": run["micro_batch"],
        "parallel.dp": run["dp"],
        "parallel.pp": run["pp"],
        "parallel.tp": run["tp"],
        "parallel.virtual": run.get("virtual", 1),
        "parallel.schedule": "interleaved-1f1b" if run.get("virtual", 1) > 1 else "1f1b",
        "precision": run["precision"],
        "ac": "full" if run["recompute"] == "full" else "none",
    }
    strategy = DP_STRATEGIES.get(run.get("dp_strategy", ""), "")
    if strategy:  # a data-parallel engine: no pipeline schedule
        args["dp.strategy"] = strategy
        if strategy == "fsdp":  # their FSDP keeps the embedding in a gathered unit
            args["dp.shard_vocab"] = "false"
        args["precision"] = FSDP_PRECISION.get(run.get("fsdp_mixed_precision", ""), args["precision"])
        del args["parallel.virtual"], args["parallel.schedule"]
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def predict(run: dict) -> Result:
    s = resolve_setup(build_config(run_args(run)), full_check=False)
    s = dataclasses.replace(
        s,
        attention="unfused" if run["attention"].startswith("unfused") else "flash",
        attention_speed=ATTENTION_SPEED.get(run["attention"], 1.0),
        dropout=bool(run.get("dropout", False)),
        seq_parallel=bool(run.get("sequence_parallel", False)),
        selective=run["recompute"] == "selective",
        # Megatron-LM's scatter/gather of pipeline activations over the TP ranks (not DeepSpeed's pipeline engine)
        p2p_scatter=run.get("system", "") in ("Megatron-LM", "NeMo"),
        master=not autocast(run),  # half-precision weights with fp32 masters, unless autocast over fp32 ones
        backward_prefetch=BACKWARD_PREFETCH[run.get("fsdp_backward_prefetch", "BACKWARD_PRE")],
        native=False,  # their own blocks, not foldtrain's
    )
    return simulate_setup(s, cluster_for(run), check_memory=False)


@dataclasses.dataclass
class Row:
    run: dict
    result: Result
    published: float  # tokens/s per GPU
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1

    def tflops(self, tokens: float) -> float:
        """Model TFLOP/s per GPU at ``tokens``/s per GPU, counted one way for every run (``palm``)."""
        return tokens * flops_per_token(self.run, "palm") / 1e12


def evaluate(runs: list[dict]) -> list[Row]:
    """Every run's prediction against its published figure, in ``runs``' order. The simulations are independent
    and pure Python, so they run in one process per core (at most one per run); the predictions are the same as
    in one process, bit for bit."""
    workers = min(len(runs), os.cpu_count() or 1)
    if workers > 1:  # spawned: a forked copy of a process that runs torch's threads may deadlock
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(predict, runs))
    else:
        results = [predict(run) for run in runs]
    return [Row(run, r, published_tokens_per_gpu(run), r.tokens_per_s / run["gpus"]) for run, r in zip(runs, results)]


def summary(rows: list[Row]) -> dict[str, float]:
    errs = [abs(r.error) for r in rows]
    return {
        "runs": len(rows),
        "median": statistics.median(errs),
        "worst": max(errs),
        "spearman": spearman([r.tflops(r.published) for r in rows], [r.tflops(r.predicted) for r in rows]),
    }


def _layout(run: dict) -> str:
    v = run.get("virtual", 1)
    return f"{run['dp']}x{run['pp']}x{run['tp']}" + (f", V={v}" if v > 1 else "")


def _model(run: dict) -> str:
    return f"{run['n_layer']}L d{run['d_model']} h{run['n_head']} s{run['seq']} V{run['vocab']:,}"


def table(rows: list[Row]) -> list[str]:
    out = [
        "| run | GPUs | model | dp x pp x tp | batch x micro | precision, recompute, attention | published "
        "| published tokens/s/GPU | predicted | error | model TFLOP/s/GPU published / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        run = r.run
        pub = f"{run['value']:g} {run['metric'].replace('_', ' ')}"
        if run["metric"] in ("model_tflops_per_gpu", "mfu"):
            pub += f" ({run['flops_formula']})"
        out.append(
            f"| [{run['id']}](#{run['id']}) | {run['gpus']:,} {run['gpu']} | {_model(run)} | {_layout(run)} "
            f"| {run['global_batch']:,} x {run['micro_batch']} | {run['precision']}, {run['recompute']}, "
            f"{run['attention']}{', SP' if run.get('sequence_parallel') else ''} | {pub} | {r.published:,.0f} "
            f"| {r.predicted:,.0f} | {r.error:+.1%} | {r.tflops(r.published):.0f} / {r.tflops(r.predicted):.0f} |"
        )
    return out


def sources(rows: list[Row]) -> list[str]:
    out = ["## The runs' sources", ""]
    for r in rows:
        run = r.run
        out += [
            f'<a id="{run["id"]}"></a>**{run["id"]}** ({run.get("system", "")}): {run["source"]}. {run.get("url", "")}',
            "",
            f"> {run['quote']}",
            "",
        ]
        if run.get("notes"):
            out += [f"Notes: {run['notes']}", ""]
    return out


def constants(presets: list[str]) -> list[str]:
    """Which source set which constant: every numeric line of the presets used, with its comment."""
    out = ["## Which source set which constant", ""]
    for name in presets:
        out += [f"`{name}` ([foldtrain/sim/clusters/{name}.toml](../foldtrain/sim/clusters/{name}.toml)):", ""]
        out += ["| field | value | source |", "|---|---|---|"]
        section = ""
        for line in (PRESET_DIR / f"{name}.toml").read_text().splitlines():
            if line.startswith("["):
                section = line.strip("[] ").split("]")[0]
            elif "=" in line and not line.startswith("#") and not line.startswith("name"):
                key, rest = line.split("=", 1)
                value, _, note = rest.partition("#")
                out.append(f"| {section}.{key.strip()} | {value.strip()} | {note.strip()} |")
        out.append("")
    return out


def by_system(rows: list[Row]) -> list[str]:
    """The median and worst error of each system's runs."""
    out = []
    for system in sorted({r.run.get("system", "") for r in rows}):
        errs = [abs(r.error) for r in rows if r.run.get("system", "") == system]
        out.append(
            f"| {system} runs ({len(errs)}): median / worst absolute error "
            f"| {statistics.median(errs):.1%} / {max(errs):.1%} | |"
        )
    return out


def render(rows: list[Row], seconds: float) -> str:
    s = summary(rows)
    lines = [
        "# The simulator against published GPU training runs",
        "",
        f"Regenerate with `{CMD}` (under a minute; nothing runs on a GPU). Each run below was made by another "
        "system on A100/H100-class clusters and published with its configuration; `foldtrain simulate` predicts "
        "it from that configuration on the preset of its GPU, with the node's GPUs and network as published. "
        "No constant was fitted to these runs: the presets' numbers come from datasheets and published "
        "microbenchmarks (last section). The weak-scaling table of Narayanan et al. (SC'21) is kept out of "
        "this set: it is an independent check.",
        "",
        "Throughput is compared as tokens/s per GPU; a published FLOP rate is converted with the FLOP count "
        "its source uses (`megatron`: with a full recomputation, `megatron-mfu`: without, `6n`, `palm`: see "
        "[foldtrain/sim/validation/gpu.py](../foldtrain/sim/validation/gpu.py)). The last column counts every "
        "run's FLOPs one way (`palm`), which is what the rank correlation compares.",
        "",
        *table(rows),
        "",
        "| metric | value | target |",
        "|---|---|---|",
        f"| runs | {s['runs']} | >= 8 |",
        f"| median absolute error | {s['median']:.1%} | <= 10% |",
        f"| worst absolute error | {s['worst']:.1%} | <= 20% |",
        f"| Spearman rank correlation (model TFLOP/s per GPU) | {s['spearman']:.2f} | |",
        *by_system(rows),
        "",
        *sources(rows),
        *constants(sorted({GPUS[r.run["gpu"]][0] for r in rows})),
        f"_Generated in {seconds:.0f} s._",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=CMD, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/validation-gpu.md", help="the Markdown file to write")
    ap.add_argument("--runs", default=str(RUNS), help="the published runs (TOML)")
    a = ap.parse_args(argv)
    t0 = time.time()
    rows = evaluate(load_runs(Path(a.runs)))
    body, path, marker = render(rows, time.time() - t0), Path(a.out), "<!-- discussion -->"
    if path.is_file() and marker in path.read_text():  # the hand-written discussion below the marker stays
        body += "\n" + path.read_text()[path.read_text().index(marker) :]
    path.write_text(body)
    s = summary(rows)
    print(f"wrote {a.out}: {s['runs']} runs, median error {s['median']:.1%}, worst {s['worst']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
