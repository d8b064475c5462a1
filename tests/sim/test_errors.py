"""Bad input: one line naming the problem, exit status 2 from the CLI."""

from __future__ import annotations

import pytest

from foldtrain.cli import main
from foldtrain.errors import ConfigError
from foldtrain.sim.cluster import from_dict, load_cluster

from .conftest import cluster_dict


def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("foldtrain: error: ") and err.count("\n") == 1
    return err


def test_unknown_preset_and_cluster(capsys):
    assert "unknown model preset 'gpt9'" in _err(capsys, ["simulate", "--model.preset", "gpt9"])
    assert "did you mean 'hal-v100'" in _err(capsys, ["simulate", "--cluster", "hal-v10"])
    assert "not found" in _err(capsys, ["simulate", "--cluster", "/nope/c.toml"])
    assert "unknown cluster" in _err(capsys, ["plan", "--cluster", "x", "--gpus", "4", "--model.preset", "tiny"])


@pytest.mark.parametrize(
    "edit,field,problem",
    [
        (lambda d: d["device"].pop("fp16_tflops"), "device.fp16_tflops", "is missing"),
        (lambda d: d["intra"].update(bw_gbs="fast"), "intra.bw_gbs", "is not a number"),
        (lambda d: d["inter"].update(latency_us=0), "inter.latency_us", "must be positive"),
        (lambda d: d["node"].update(gpus=-8), "node.gpus", "must be positive"),
        (lambda d: d["device"].update(backward_ratio=-1), "device.backward_ratio", "must be a non-negative number"),
    ],
)
def test_bad_cluster_fields_name_the_field(edit, field, problem):
    d = cluster_dict()
    edit(d)
    with pytest.raises(ConfigError, match=f"field {field} {problem}"):
        from_dict(d, "c.toml")


def test_bad_cluster_file_via_cli(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text('name = "c"\n[node]\ngpus = 4\n')
    assert "section [device] is missing" in _err(capsys, ["simulate", "--cluster", str(f)])
    f.write_text(
        load_cluster("hal-v100").source
        and open(load_cluster("hal-v100").source).read().replace("mem_bw_gbs = 900.0", "mem_bw_gbs = -1")
    )
    assert "field device.mem_bw_gbs must be positive" in _err(capsys, ["simulate", "--cluster", str(f)])


def test_layouts_that_do_not_divide(capsys):
    # more segments than layers
    assert "segments would leave a segment empty" in _err(
        capsys,
        [
            "simulate",
            "--model.preset",
            "tiny",
            "--parallel.pp",
            "4",
            "--parallel.virtual",
            "2",
            "--parallel.schedule",
            "fold",
            "--train.global_batch",
            "8",
        ],
    )
    # plan: a GPU count the layout cannot use
    assert "--gpus 7" in _err(
        capsys, ["plan", "--model.preset", "tiny", "--cluster", "hal-v100", "--gpus", "7", "--train.global_batch", "5"]
    )
    # tensor parallelism that does not divide the heads
    assert "not divisible by --parallel.tp 3" in _err(
        capsys, ["simulate", "--model.preset", "tiny", "--parallel.tp", "3"]
    )


def test_does_not_fit_prints_the_breakdown(capsys):
    err = _err(
        capsys,
        [
            "simulate",
            "--model.preset",
            "gpt3-13b",
            "--cluster",
            "hal-v100",
            "--train.global_batch",
            "1",
            "--train.seq_len",
            "2048",
        ],
    )
    assert "does not fit" in err and "params" in err and "optimizer" in err and "activations" in err and "GB" in err


def test_calibrate_network_without_prerequisites(capsys, monkeypatch):
    import foldtrain.netem.cluster as netns
    from foldtrain.errors import FoldtrainError

    def missing():
        raise FoldtrainError(netns.NEEDS_ROOT)

    monkeypatch.setattr(netns, "check_prerequisites", missing)
    err = _err(capsys, ["calibrate", "--out", "/tmp/never.toml", "--network", "1gbit", "--nodes", "2"])
    assert "root" in err and "iproute2" in err
