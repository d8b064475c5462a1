"""The emulated network: namespaces, shaping, reachability, teardown (always), and the clear error
without root. As root with iproute2 (CI) the real path runs; otherwise only the error is checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from foldtrain.errors import FoldtrainError
from foldtrain.netem import cluster as netns
from foldtrain.netem.cluster import NEEDS_ROOT, EmulatedCluster, list_prefix

PREFIX = f"ftt{os.getpid() % 100000}"


def can_emulate() -> bool:
    try:
        netns.check_prerequisites()
        return True
    except FoldtrainError:
        return False


needs_root = pytest.mark.skipif(not can_emulate(), reason="needs root and iproute2 (the error path is tested instead)")


@pytest.fixture(autouse=True, scope="module")
def _remove_lock_files():
    yield
    # the clusters leave their (empty) lock files; these prefixes are ours
    for f in netns.LOCK_DIR.glob(f"{PREFIX}*.lock"):
        f.unlink(missing_ok=True)


def assert_gone(prefix: str = PREFIX) -> None:
    namespaces, links = list_prefix(prefix)
    assert namespaces == [] and links == [], f"leftovers: {namespaces} {links}"


def test_without_root_a_clear_error(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(FoldtrainError) as e:
        with EmulatedCluster(2, "100mbit", name_prefix=PREFIX):
            pass
    assert str(e.value) == NEEDS_ROOT and "\n" not in str(e.value)


def test_without_ip_a_clear_error(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(FoldtrainError, match="apt-get install iproute2"):
        netns.check_prerequisites()


def test_bad_arguments():
    with pytest.raises(FoldtrainError, match="name_prefix"):
        EmulatedCluster(2, name_prefix="Bad-Prefix!")
    with pytest.raises(FoldtrainError, match="not a rate"):
        EmulatedCluster(2, rate="quick")
    with pytest.raises(FoldtrainError, match="1 to 200 nodes"):
        EmulatedCluster(0)


@needs_root
def test_two_nodes_at_100mbit_reach_each_other_and_are_shaped():
    with EmulatedCluster(2, "100mbit", name_prefix=PREFIX) as c:
        namespaces, links = list_prefix(PREFIX)
        assert sorted(namespaces) == [f"{PREFIX}-n0", f"{PREFIX}-n1"]
        assert sorted(links) == [f"{PREFIX}-br", f"{PREFIX}-h0", f"{PREFIX}-h1"]
        assert c.addr(0) == "198.18.0.1" and c.addr(1) == "198.18.0.2"
        # both directions answer a TCP echo
        assert 0 < c.ping(0, 1) < 5 and 0 < c.ping(1, 0) < 5
        # lo is up inside a node
        lo = subprocess.run(c.node_cmd(0, ["ip", "-o", "link", "show", "lo"]), capture_output=True, text=True).stdout
        assert "UP" in lo
        # both ends of each link are shaped
        qd = subprocess.run(
            c.node_cmd(0, ["tc", "qdisc", "show", "dev", c.ifname(0)]), capture_output=True, text=True
        ).stdout
        assert "tbf" in qd and "100Mbit" in qd
        assert (
            "tbf"
            in subprocess.run(["tc", "qdisc", "show", "dev", c.host_ifname(1)], capture_output=True, text=True).stdout
        )
        limit = 100e6 / 8
        bps = c.measure_throughput(0, 1, nbytes=3 << 20, max_s=5)
        assert 0.2 * limit < bps < 3 * limit, f"{bps / 1e6:.1f} MB/s through a 12.5 MB/s link"
        sent, _ = c.link_bytes(0)
        assert sent >= 3 << 20  # the link counters saw the stream
    assert_gone()


@needs_root
def test_teardown_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, "100mbit", name_prefix=PREFIX) as c:
            c.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])  # a process left running in a node
            assert len(list_prefix(PREFIX)[0]) == 2
            raise RuntimeError("boom")
    assert_gone()


@needs_root
def test_stale_leftovers_removed_and_prefix_locked():
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-n7"], check=True)  # as if a crashed run left it
    subprocess.run(["ip", "link", "add", f"{PREFIX}-br", "type", "bridge"], check=True)
    try:
        with EmulatedCluster(1, "1gbit", name_prefix=PREFIX):
            assert list_prefix(PREFIX)[0] == [f"{PREFIX}-n0"]
            with pytest.raises(FoldtrainError, match="in use by process"):
                with EmulatedCluster(1, "1gbit", name_prefix=PREFIX):
                    pass
            assert list_prefix(PREFIX)[0] == [f"{PREFIX}-n0"]  # the refused second cluster touched nothing
    finally:
        netns.cleanup_prefix(PREFIX)
    assert_gone()


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_teardown_on_signal(sig):
    prefix = f"{PREFIX}s"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from foldtrain.netem.cluster import EmulatedCluster
        with EmulatedCluster(2, "100mbit", name_prefix="{prefix}"):
            print("up", flush=True)
            time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "up"
        assert len(list_prefix(prefix)[0]) == 2
        child.send_signal(sig)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            netns.cleanup_prefix(prefix)
    assert child.returncode != 0
    assert_gone(prefix)


GLOO_SCRIPT = """
import os, socket, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1 << 18)  # 1 MiB
dist.all_reduce(t)
if dist.get_rank() == 0:
    print("SUM", float(t[0]), dist.get_world_size(), flush=True)
dist.destroy_process_group()
"""


@needs_root
def test_torchrun_across_nodes(tmp_path):
    """One torchrun per node, gloo over the nodes' NICs: a real all-reduce through the shaped links."""
    script = tmp_path / "allreduce.py"
    script.write_text(GLOO_SCRIPT)
    with EmulatedCluster(2, "1gbit", name_prefix=PREFIX) as c:
        before = c.link_bytes(1)
        res = c.run_torchrun([str(script)], nproc_per_node=1, timeout_s=120, log_dir=tmp_path / "logs")
        after = c.link_bytes(1)
    assert res.ok, res.text()[-2000:]
    assert "SUM 2.0 2" in res.text()
    assert after[0] - before[0] > 1 << 20  # node 1 sent its tensor over its link
    assert_gone()
