"""``foldtrain simulate`` and ``foldtrain plan`` (and the entry of ``foldtrain calibrate``).

Kept out of :mod:`foldtrain.cli` so the simulator's commands stay one separable block there.
"""

from __future__ import annotations

import argparse

from foldtrain.errors import ConfigError


def simulate_main(argv: list[str]) -> int:
    from foldtrain.config import build_config
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.report import format_table, to_json_text, write_profile
    from foldtrain.sim.simulate import simulate

    p = argparse.ArgumentParser(
        prog="foldtrain simulate",
        allow_abbrev=False,
        description="predict a `foldtrain train` configuration on a cluster; launches nothing",
    )
    p.add_argument("--config", help="TOML file with config sections (as for train)")
    p.add_argument("--cluster", default="dgx-a100", help="preset name or cluster TOML file (default dgx-a100)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--profile", dest="profile_dir", metavar="DIR", help="write timeline.json and gantt.png here")
    ns, rest = p.parse_known_args(argv)
    cluster = load_cluster(ns.cluster)
    cfg = build_config(rest, ns.config)
    r = simulate(cfg, cluster, keep_events=bool(ns.profile_dir))
    print(to_json_text(r) if ns.json else format_table(r))
    if ns.profile_dir:
        paths = write_profile(r, ns.profile_dir)
        if not ns.json:
            print("wrote " + ", ".join(paths))
    return 0


def plan_main(argv: list[str]) -> int:
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.plan import format_plan, plan, plan_toml

    p = argparse.ArgumentParser(
        prog="foldtrain plan",
        allow_abbrev=False,
        description="search layouts of a model on a cluster and rank them by predicted throughput",
    )
    p.add_argument("--config", help="TOML file with config sections (the base the plan modifies)")
    p.add_argument("--cluster", required=True, help="preset name or cluster TOML file")
    p.add_argument("--gpus", type=int, required=True, help="devices (ranks) to use")
    p.add_argument("--out", help="write the best configuration as TOML (for foldtrain train --config)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    ns, rest = p.parse_known_args(argv)
    if ns.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {ns.gpus}")
    cluster = load_cluster(ns.cluster)
    res = plan(rest, ns.config, cluster, ns.gpus)
    if ns.json:
        import json

        print(json.dumps({"candidates": res.simulated, "best": [c.to_json() for c in res.top[: ns.top]]}))
    else:
        print(format_plan(res, ns.top))
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(plan_toml(res))
        if not ns.json:
            print(f"wrote {ns.out} (run it with: foldtrain train --config {ns.out})")
    return 0


def calibrate_main(argv: list[str]) -> int:
    from foldtrain.calibrate import main

    return main(argv)
