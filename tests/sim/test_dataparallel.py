"""The simulator's ``--dp.strategy dataparallel`` (``torch.nn.DataParallel``, :mod:`foldtrain.sim.dataparallel`):
each mechanism of its step moves the prediction the way it should, and ``foldtrain simulate`` reports it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from foldtrain.cli import main
from foldtrain.config import build_config
from foldtrain.errors import ConfigError
from foldtrain.sim.cluster import from_dict, load_cluster
from foldtrain.sim.costs import CostModel, model_params
from foldtrain.sim.dataparallel import BUCKET, phases, simulate_dataparallel
from foldtrain.sim.setup import resolve_setup
from foldtrain.sim.simulate import simulate, simulate_setup
from tests.sim.conftest import cluster_dict

GPT2 = ["--model.preset", "bai2022", "--train.seq_len", "512"]


def setup(n: int, per_device: int = 1, *args: str):
    """HP3C'22's GPT-2 on ``n`` devices, ``per_device`` rows each in one forward."""
    dp = ["--dp.strategy", "dataparallel", "--parallel.dp", str(n)] if n > 1 else []
    return resolve_setup(build_config([*GPT2, "--train.global_batch", str(n * per_device), *dp, *args]))


def test_rows_are_scattered_over_the_devices():
    s = setup(4, 2, "--train.micro_batch", "4")
    assert (s.strategy, s.dp, s.microbatches, s.micro_batch) == ("dataparallel", 4, 2, 1)
    assert s.tokens_per_step == 8 * 512
    one = setup(1, 4)  # one device: DataParallel calls the module itself, the single-process step
    assert (one.strategy, one.microbatches, one.micro_batch) == ("none", 1, 4)
    with pytest.raises(ConfigError, match="multiple of 4"):
        resolve_setup(
            build_config([*GPT2, "--train.global_batch", "6", "--dp.strategy", "dataparallel", "--parallel.dp", "4"])
        )


def test_links_cost_what_torch_moves_over_them():
    """Replicate: the token ids scattered, then the weights broadcast in 10 MiB buckets of N - 1 hops each;
    gather: N - 1 replicas' logits into device 0 and their gradient back; reduce: the gradients in buckets."""
    c = load_cluster("hal-v100")
    s = setup(4)
    ph = phases(s, c)
    lat, bw = c.intra.coll, c.intra.bw
    weights = model_params(s) * 4
    ids = 3 * 512 * 8
    assert ph.replicate == pytest.approx(lat + ids / bw + math.ceil(weights / BUCKET) * 3 * lat + weights / bw)
    assert ph.gather == pytest.approx(2 * (lat + 3 * 512 * s.vocab * 4 / bw))
    assert ph.reduce == pytest.approx(math.ceil(weights / BUCKET) * 3 * lat + weights / bw)


def test_more_devices_cost_more_copies_and_less_utilisation():
    c = load_cluster("hal-v100")
    two, four = phases(setup(2), c), phases(setup(4), c)
    assert four.gather == pytest.approx(3 * two.gather, rel=0.01)  # N - 1 replicas' logits into device 0
    assert four.replicate > two.replicate and four.reduce > two.reduce  # N - 1 hops per bucket
    util = [1 - simulate_setup(setup(n), c, check_memory=False).bubble for n in (2, 3, 4)]
    assert util[0] > util[1] > util[2]


def test_the_host_launches_every_devices_forward_one_after_another():
    """With the host's work per block and pass far above the device's, the forward takes N times one device's
    launches, and the devices compute the same as with free launches; the backward does not serialise."""
    c = load_cluster("hal-v100")
    slow = dataclasses.replace(c, layer_overhead=20e-3)
    for n in (2, 4):
        fast_ph, slow_ph = phases(setup(n), c), phases(setup(n), slow)
        assert slow_ph.forward == pytest.approx(n * slow_ph.host_forward)
        assert slow_ph.host_forward == pytest.approx(12 * 20e-3, rel=0.01)  # one layer_overhead per block
        assert slow_ph.forward_busy == pytest.approx(fast_ph.forward_busy)
        assert fast_ph.forward < n * fast_ph.host_forward + fast_ph.forward_busy  # the preset: device-bound
        cm = CostModel(setup(n), slow)
        assert slow_ph.backward == pytest.approx(cm.backward(0))


def test_free_links_and_launches_scale_perfectly():
    """Without link and host costs, N devices of ``b`` rows take one device's step of ``b`` rows."""
    c = from_dict(cluster_dict(intra__bw_gbs=1e12, intra__latency_us=1e-12))
    one = simulate_setup(setup(1, 2), c, check_memory=False)
    four = simulate_setup(setup(4, 2), c, check_memory=False)
    assert four.step_time == pytest.approx(one.step_time, rel=1e-6)
    assert four.tokens_per_s == pytest.approx(4 * one.tokens_per_s, rel=1e-6)


def test_device_0_holds_the_optimizer_and_the_whole_loss():
    c = load_cluster("hal-v100")
    mem = simulate_setup(setup(4, 2), c).memory
    assert len(mem) == 4 and mem[1] == mem[2] == mem[3]
    first, other = mem[0], mem[1]
    assert first["total"] > other["total"]
    assert first["params"] == other["params"] and first["optimizer"] > 0 == other["optimizer"]
    assert first["comm_buffers"] == first["grads"]  # its replica's gradients, until the reduce
    assert first["activations"] > other["activations"]  # the loss's (b, L, V) buffers of every replica's rows


def test_refusals_are_one_line():
    c = load_cluster("hal-v100")
    with pytest.raises(ConfigError, match="one node") as e:
        simulate_dataparallel(setup(8), c)
    assert "\n" not in str(e.value)
    small = dataclasses.replace(c, memory=3e9)
    with pytest.raises(ConfigError, match="device 0 needs") as e:
        simulate_dataparallel(setup(4, 4), small)
    assert "\n" not in str(e.value)
    simulate_dataparallel(setup(4, 4), small, check_memory=False)


def test_simulate_reports_throughput_utilisation_and_memory_per_device(capsys, tmp_path):
    args = [*GPT2, "--train.global_batch", "4", "--dp.strategy", "dataparallel", "--parallel.dp", "4"]
    assert main(["simulate", "--cluster", "hal-v100", *args, "--profile", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for line in ("throughput", "MFU", "bubble", "exposed DP", "peak memory", "note: dataparallel over 4 GPUs"):
        assert line in out, out
    rows = [x.split() for x in out.splitlines() if x.split() and x.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert (tmp_path / "timeline.json").is_file()
    r = simulate(build_config(args), load_cluster("hal-v100"), keep_events=True)
    assert r.tokens_per_s * r.step_time == pytest.approx(4 * 512)
    assert 0 < r.bubble < 1 and r.exposed_dp > 0
    kinds = [{e["kind"] for e in evs} for evs in r.events]
    assert "optim" in kinds[0] and all("optim" not in k and "compute" in k for k in kinds[1:])
