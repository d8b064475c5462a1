"""`foldtrain simulate` / `plan` end to end (pure: no process is launched)."""

from __future__ import annotations

import json

from foldtrain.cli import main
from foldtrain.config import build_config, validate_world
from foldtrain.profile import load_events  # noqa: F401 - the same package reads real runs

FOLD = [
    "--model.preset",
    "tiny",
    "--parallel.dp",
    "2",
    "--parallel.pp",
    "2",
    "--parallel.virtual",
    "2",
    "--parallel.schedule",
    "fold",
    "--parallel.dp_sync",
    "per-chunk",
    "--train.global_batch",
    "8",
]


def test_simulate_json_is_one_object(capsys):
    assert main(["simulate", "--cluster", "dgx-a100", "--json", *FOLD]) == 0
    out = capsys.readouterr().out.strip()
    d = json.loads(out)
    assert out.count("\n") == 0
    for k in ("step_time_s", "tokens_per_s", "mfu", "bubble", "all_rank_idle", "exposed_dp_s", "peak_mem_gb"):
        assert isinstance(d[k], float) and d[k] >= 0
    assert len(d["memory_gb"]) == 2 and {"params", "grads", "optimizer", "activations", "total"} <= set(
        d["memory_gb"][0]
    )
    assert d["tokens_per_s"] * d["step_time_s"] == 8 * 128  # global batch x seq_len


def test_simulate_takes_the_train_toml_and_writes_a_profile(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[model]\npreset = "tiny"\n[parallel]\ndp = 2\npp = 2\nvirtual = 2\nschedule = "fold"\n'
        'dp_sync = "per-chunk"\n[train]\nglobal_batch = 8\n'
    )
    prof = tmp_path / "prof"
    assert main(["simulate", "--config", str(cfg), "--cluster", "cloud-v100-25g", "--profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "fold dp_sync=per-chunk" in out and "tokens/s" in out
    trace = json.loads((prof / "timeline.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e.get("ph") == "X"}
    assert {"F c0 m0", "B c3 m3", "reduce c2"} <= names
    assert (prof / "gantt.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_writes_a_config_train_accepts(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert (
        main(
            [
                "plan",
                "--model.preset",
                "tiny",
                "--cluster",
                "dgx-a100",
                "--gpus",
                "4",
                "--train.global_batch",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.count("\n 1 ") + text.count("\n1 ") >= 1 and "wrote" in text
    cfg = build_config([], str(out))
    from foldtrain.schedules.layout import uses_3d_engine

    world = cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp if uses_3d_engine(cfg) else 4
    validate_world(cfg, world)


def test_the_simulator_pads_the_vocabulary_as_the_trainer_does():
    """GPT-2's 50,257 words under tp 4: the simulated embedding has the trainer's 50,260 rows, and plan
    considers tensor-parallel layouts of it."""
    from foldtrain.model.gpt import GPTShape
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.plan import _variants
    from foldtrain.sim.setup import resolve_setup

    args = ["--model.preset", "gpt2-small", "--parallel.tp", "4", "--train.global_batch", "8"]
    cfg = build_config([*args, "--train.micro_batch", "1", "--parallel.schedule", "gpipe"])
    assert resolve_setup(cfg).vocab == GPTShape.from_config(cfg.model, 4).embedding_rows == 50260
    tps = {v["tp"] for v in _variants(build_config(args), 8, load_cluster("dgx-a100"))}
    assert tps == {1, 2, 4}  # 12 heads: tp 8 does not divide them; the odd vocabulary no longer rules tp out


def test_plan_considers_the_zero_bubble_schedules_where_they_run():
    """zb-h1 with one chunk per rank, zbv with two, interleaved-zb where M is a multiple of P, fold-zb with and
    without deferral (when clipping is off); each candidate is a layout the trainer accepts, and the closed form
    prices a split schedule's fill as F + I, below its whole-backward twin's."""
    from foldtrain.schedules import build_schedule
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.plan import _make_cfg, _variants, estimate
    from foldtrain.sim.setup import resolve_setup

    base = build_config(["--model.preset", "gpt2-small", "--train.global_batch", "16", "--optim.grad_clip", "0"])
    c = load_cluster("dgx-a100")
    cands = list(_variants(base, 8, c))
    by = {(x["schedule"], x["virtual"]) for x in cands if x["pp"] > 1}
    assert {("zb-h1", 1), ("zbv", 2), ("interleaved-zb", 2), ("fold-zb", 4)} <= by
    assert not {s for s, v in by if s == "zbv" and v != 2} and not {s for s, v in by if s == "zb-h1" and v != 1}
    assert any(x["schedule"] == "fold-zb" and x["defer"] for x in cands)
    for x in cands:
        if x["pp"] > 1:
            build_schedule(x["schedule"], x["pp"], x["virtual"], x["M"], x["dp_sync"], x["defer"])
    pick = next(x for x in cands if x["schedule"] == "zb-h1" and x["ac"] == "none")
    zb = resolve_setup(_make_cfg(base, pick))
    one = resolve_setup(_make_cfg(base, dict(pick, schedule="1f1b")))
    assert estimate(zb, c)[0] < estimate(one, c)[0]


def test_plan_considers_slicing_the_tied_state_where_the_pipeline_splits_the_tie():
    """The distributed optimizer is searched with and without --optim.shard_tied where pp > 1 (the same run
    where the tie is whole on one rank), only with it when the base config sets it; with it the closed form
    holds less optimizer state on the first pipeline rank at dp 4 (1/dp of the tied copy's against the half the
    two ends split by default), and the same at dp 2."""
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.plan import _make_cfg, _variants, estimate
    from foldtrain.sim.setup import resolve_setup

    c = load_cluster("dgx-a100")
    base = build_config(["--model.preset", "gpt2-small", "--train.global_batch", "16"])
    cands = list(_variants(base, 8, c))
    assert any(x.get("tied") for x in cands)
    assert not any(x.get("tied") for x in cands if not x.get("dist") or x["pp"] == 1)
    pick = next(x for x in cands if x.get("tied") and x["dp"] == 4 and x["pp"] == 2)
    tied, split = (estimate(resolve_setup(_make_cfg(base, dict(pick, tied=t))), c) for t in (True, False))
    assert tied[1] < split[1]
    pick2 = next(x for x in cands if x.get("tied") and x["dp"] == 2 and x["pp"] == 2)
    tied2, split2 = (estimate(resolve_setup(_make_cfg(base, dict(pick2, tied=t))), c) for t in (True, False))
    assert tied2[1] == split2[1]
    assert "shard-tied" in _label(base, pick)
    only = build_config(["--model.preset", "gpt2-small", "--train.global_batch", "16", "--optim.distributed", "true"])
    only.optim.shard_tied = True
    assert all(x["tied"] for x in _variants(only, 8, c) if x.get("dist") and x["pp"] > 1)


def _label(base, cand) -> str:
    from foldtrain.sim.plan import Candidate, _make_cfg
    from foldtrain.sim.setup import resolve_setup

    cfg = _make_cfg(base, cand)
    return Candidate(cfg, resolve_setup(cfg), 0.0, 0.0).label()
