"""FSDP2's cost in the 3D engine, measured and simulated: the executor's probe (``foldtrain calibrate``'s
negligible 2-stage pipeline, dp 2: four ranks) plain, with ``--dp.strategy fsdp`` and with its blocks kept
gathered (``--dp.reshard_after_forward false``), in turn, each against ``foldtrain simulate`` on the cluster
file (calibrate it for the runs' four processes first). Prints each run's step and fsdp's excess over the
plain run of its round (docs/benchmarks.md, "ZB-H1 with FSDP").

    foldtrain calibrate --out cal.toml --ranks_per_node 4
    python scripts/fsdp_probe.py cal.toml [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses

from foldtrain.calibrate.executor import probe_step
from foldtrain.sim.cluster import load_cluster
from foldtrain.sim.simulate import simulate

VARIANTS = {
    "plain": (),
    "fsdp": ("--dp.strategy", "fsdp"),
    "fsdp, blocks kept gathered": ("--dp.strategy", "fsdp", "--dp.reshard_after_forward", "false"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cluster", help="a cluster file from foldtrain calibrate --ranks_per_node 4")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    cluster = load_cluster(a.cluster)
    print("| round | run | measured ms | simulated ms | error | measured over plain | simulated over plain |")
    print("|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        base: tuple[float, float] | None = None
        for name, extra in VARIANTS.items():
            cfg, measured = probe_step(2, extra)
            sim = simulate(cfg, dataclasses.replace(cluster, memory=1e12, gpus_per_node=4)).step_time
            base = base or (measured, sim)
            over = f"+{(measured - base[0]) * 1e3:.0f} | +{(sim - base[1]) * 1e3:.0f}" if name != "plain" else "— | —"
            err = f"{(sim - measured) / measured:+.1%}"
            print(f"| {r + 1} | {name} | {measured * 1e3:.1f} | {sim * 1e3:.1f} | {err} | {over} |", flush=True)


if __name__ == "__main__":
    main()
