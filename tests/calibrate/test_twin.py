"""``foldtrain calibrate --device cpu --probes kernels``: the whole ``--device cuda`` path on the CPU and gloo, in
one process and under torchrun (4 ranks as 2 nodes of 2), its file read back by the simulator."""

from __future__ import annotations

import math
import re

import pytest

from foldtrain.cli import main
from foldtrain.config.load import tomllib
from foldtrain.sim import ops
from foldtrain.sim.cluster import from_dict, load_cluster
from tests.support import failed, torchrun

TINY = ["--preset", "tiny", "--micro_batch", "2", "--seq", "32"]


def notes(text: str) -> dict[str, str]:
    """``section.key`` -> its comment, for every number of the file's [node], [device], [intra], [inter]."""
    out, sec = {}, ""
    for line in text.splitlines():
        if m := re.match(r"\[(\w+)\]", line):
            sec = m.group(1)
        elif m := re.match(r"(\w+) = [-\d.e+]+(?:  # (.*))?$", line):
            out[f"{sec}.{m.group(1)}"] = m.group(2) or ""
    return out


def simulate(path, *args: str) -> None:
    argv = ["simulate", "--cluster", str(path), "--model.preset", "tiny", "--train.seq_len", "32", *args]
    assert main(argv) == 0


def test_one_process_writes_a_cluster_file_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "here.toml"
    argv = ["calibrate", "--device", "cpu", "--probes", "kernels", *TINY, "--links", "hal-v100", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    c = from_dict(tomllib.loads(text), str(out))
    shape = ops.BlockShape(b=2, L=32, d=96, heads=4, t=1, e=2)
    # the table holds exactly the products a step of tiny multiplies
    assert sorted(c.gemm.rates["bf16"]) == ops.gemm_shapes(shape, 8192)
    assert all(r > 0 and math.isfinite(r) for r in c.gemm.rates["bf16"].values())
    assert c.attn_fwd.get("bf16", ops.attention_shape(shape)) > 0 < c.attn_bwd.get("bf16", ops.attention_shape(shape))
    for v in (c.launch, c.norm_bw, c.gelu_bw, c.softmax_bw, c.adamw_bw, c.elem_bw, c.mem_bw, c.runtime, c.half_size):
        assert v > 0 and math.isfinite(v)
    assert 0 < c.efficiency <= 1 and 0 < c.attn_eff <= 1 and 0 < c.attn_bwd_eff <= 1
    n = notes(text)
    assert text.startswith("# measured by foldtrain calibrate --device cpu --probes kernels")
    assert "torch " in text.splitlines()[1]
    for key in ("device.launch_us", "device.norm_gbs", "device.gelu_gbs", "device.softmax_gbs", "device.adamw_gbs"):
        assert n[key].startswith("measured on the CPU"), key
    assert all(n[k] for k in n), [k for k in n if not n[k]]  # every number says where it comes from
    # one process measures no link: the preset's, and the file says so
    hal = load_cluster("hal-v100")
    assert c.intra == hal.intra and c.inter == hal.inter
    assert n["intra.bw_gbs"] == n["inter.latency_us"] == "not measured (one process): from preset hal-v100"
    simulate(out, "--precision", "bf16", "--train.global_batch", "2")
    assert "step time" in capsys.readouterr().out


def test_torchrun_measures_links_inside_and_between_nodes(tmp_path, capsys):
    out = tmp_path / "gloo.toml"
    args = ["-m", "foldtrain", "calibrate", "--device", "cpu", "--probes", "kernels", *TINY, "--precision", "fp32"]
    p = torchrun(4, *args, "--ranks_per_node", "2", "--out", str(out), timeout=300)
    assert p.returncode == 0, failed(p)
    text = out.read_text()
    c = from_dict(tomllib.loads(text), str(out))
    n = notes(text)
    assert c.gpus_per_node == 2
    for sec, where in (("intra", "over the 2 ranks of a node"), ("inter", "on each of 2 nodes at once")):
        link = getattr(c, sec)
        for v in (link.bw, link.latency, link.hop, link.p2p_bw, link.rs_bw, link.ag_bw):
            assert v > 0 and math.isfinite(v), (sec, link)
        assert n[f"{sec}.bw_gbs"].startswith("measured on the CPU") and where in n[f"{sec}.bw_gbs"]
        # the field is the curve's largest size (the note lists the curve in GB/s, 3 digits)
        curve = n[f"{sec}.bw_gbs"].rsplit(":", 1)[1].split(",")
        assert len(curve) == 5 and float(curve[-1]) == pytest.approx(link.bw / 1e9, rel=5e-3)
    # compute beside the collectives: 4 ranks' products and gloo's threads on 2 cores, so clearly slower
    assert 0 < c.overlap_slowdown < 20 and n["device.overlap_slowdown"].startswith("measured on the CPU")
    assert "beside gloo all-reduces" in n["device.overlap_slowdown"]
    simulate(out, "--parallel.dp", "4", "--dp.strategy", "ddp", "--train.global_batch", "4")
    assert "step time" in capsys.readouterr().out
