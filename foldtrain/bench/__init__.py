"""``foldtrain bench``: the benchmark harness.

    foldtrain bench dp [--quick] [--strategies ...] [--precisions ...] [--ranks 1,2,4] [--networks loopback,1gbit] ...
    foldtrain bench pipeline [--quick] [--networks 1gbit,100mbit] [--schedules ...] ...

Every run is a real ``foldtrain train`` launched by torchrun (or an anchor script written with
plain PyTorch), on loopback or on an emulated slow network of Linux network namespaces
(:mod:`foldtrain.netem`, needs root and iproute2). Results come from each run's
``metrics.jsonl`` (:mod:`foldtrain.bench.results`); a run that fails becomes a table row with its
error and the benchmark goes on.

Modules: ``runner`` (launching
one run), ``results`` (pure: medians, tables, ratios), ``dp`` and ``pipeline`` (the two
benchmarks), ``anchors`` (the baselines). This package imports nothing heavy at import time.
"""

from __future__ import annotations

import sys

USAGE = """usage: foldtrain bench {dp,pipeline,overhead,memory,dist-optim,fsdp-memory,hashing,simulator,planner,
                        data,chaos,checkpoint} [options]

benchmarks:
  dp         data-parallel strategies x precisions x 1/2/4 ranks, loopback and an emulated slow network,
             against a plain-PyTorch DDP loop (and Horovod when installed)
  pipeline   pipeline schedules (gpipe, 1f1b, interleaved-1f1b, fold) with data parallelism across two
             emulated nodes, against torch.distributed.pipelining (and DeepSpeed when installed)
  overhead   the single-process trainer against a minimal plain-PyTorch loop (tokens/s, same model and data)
  memory     peak RSS per pipeline rank at the first step against the analytic state it owns
  dist-optim the 3D engine's optimizer state and masters per rank with and without --optim.distributed,
             against the simulator's memory model
  fsdp-memory what each --dp.strategy fsdp rank holds (its shards, the most it unshards at once) against
             1/N of the model and the simulator's memory model
  hashing    the cost of checkpoint checksums next to the save itself, for several hash functions
  simulator  calibrate this machine, run dp and pipeline benches, and compare the simulator's predictions
  planner    the planner's first choice among the 4-rank layouts this machine runs, against the measured best
  data       streaming sharded prepare against plain encode_batch + tofile: MB/s per core, peak memory
  chaos      ranks killed at random moments under torchrun --max-restarts (and a whole emulated node lost):
             final parameters equal an uninterrupted run's bit for bit, every step logged once
  checkpoint the stall per save with and without --checkpoint.async (DCP async_save), in one invocation

`foldtrain bench dp --help` / `foldtrain bench pipeline --help` list the options; --quick runs a tiny
smoke configuration; --dry_run prints the runs without starting them. The emulated network needs root
and iproute2 (ip, tc); without them the throttled part is skipped.
"""


BENCHMARKS = {
    name: f"foldtrain.bench.{name.replace('-', '_')}"
    for name in (
        "dp",
        "pipeline",
        "overhead",
        "memory",
        "dist-optim",
        "fsdp-memory",
        "hashing",
        "simulator",
        "planner",
        "data",
        "chaos",
        "checkpoint",
    )
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in BENCHMARKS:
        print(
            f"foldtrain bench: unknown benchmark '{cmd}'; choose one of {', '.join(BENCHMARKS)} "
            "(see `foldtrain bench --help`)",
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(BENCHMARKS[cmd]).main(rest)
