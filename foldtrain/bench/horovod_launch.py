"""Horovod jobs for the benchmarks: ``horovodrun`` on loopback, the same launch by hand on the emulated network.

On loopback a Horovod run is what a user types: ``horovodrun -np N -H localhost:N PYTHON ...``,
with the ``horovodrun`` installed next to ``sys.executable`` (:func:`horovodrun_command`).

Across the emulated nodes horovodrun would start the remote processes through ssh, which network
namespaces do not have. So :func:`run_horovod` does what ``horovodrun`` does for gloo, with
Horovod's own pieces: it plans the slots (``get_host_assignments``), starts Horovod's HTTP
``RendezvousServer`` as a small process in node 0 (``python -m foldtrain.bench.horovod_launch
serve``), and starts every process in its node with the variables horovodrun would give it
(``create_slot_env_vars``: ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ...;
``create_run_env_vars``: the rendezvous address, the gloo controller and CPU operations, the NIC).
A node's host name is its address on the emulated network, its NIC is its veth, so Horovod's (and
foldtrain's) traffic between nodes crosses the shaped links.

The tuning a user would do (``HOROVOD_CYCLE_TIME``, ``HOROVOD_FUSION_THRESHOLD``) reaches every
process through the job's environment in both cases.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from foldtrain.errors import FoldtrainError
from foldtrain.netem.cluster import EmulatedCluster, JobResult, _readline
from foldtrain.netem.procs import kill_tree, wait_all


def horovodrun_command(n: int) -> list[str]:
    """``horovodrun -np n -H localhost:n PYTHON`` with the horovodrun of this Python's environment."""
    exe = Path(sys.executable).with_name("horovodrun")
    path = str(exe) if exe.is_file() else shutil.which("horovodrun")
    if not path:
        raise FoldtrainError(
            f"no horovodrun next to {sys.executable} or on PATH; install Horovod for this Python "
            "(bash scripts/install-horovod.sh)"
        )
    return [path, "-np", str(n), "-H", f"localhost:{n}", sys.executable]


def slot_plan(hosts: list[str], nproc_per_node: int):
    """Horovod's slot assignment of ``nproc_per_node`` processes on each host (rank = host-major)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    spec = ",".join(f"{h}:{nproc_per_node}" for h in hosts)
    return get_host_assignments(parse_hosts(spec), len(hosts) * nproc_per_node)


def run_horovod(
    cluster: EmulatedCluster,
    script_args: list[str],
    nproc_per_node: int = 1,
    nnodes: int | None = None,
    env: dict[str, str] | None = None,
    threads: int = 1,
    timeout_s: float = 600.0,
    log_dir: str | Path | None = None,
    python: str = sys.executable,
    on_poll=None,
) -> JobResult:
    """Run ``python *script_args`` as a Horovod (gloo) job of ``nproc_per_node`` processes on each of
    ``nnodes`` emulated nodes; like :meth:`EmulatedCluster.run_torchrun` (one log per process)."""
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

    n = nnodes or cluster.n_nodes
    if not 1 <= n <= cluster.n_nodes:
        raise FoldtrainError(f"the job wants {n} nodes but the cluster has {cluster.n_nodes}")
    hosts = [cluster.addr(k) for k in range(n)]
    log_dir = Path(log_dir or ".")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs, files = [], [], []
    t0 = time.monotonic()
    server_log = open(log_dir / "rendezvous.log", "w")
    files.append(server_log)
    server = cluster.popen(
        0,
        [python, "-m", "foldtrain.bench.horovod_launch", "serve", ",".join(hosts), str(nproc_per_node)],
        stdout=subprocess.PIPE,
        stderr=server_log,
        text=True,
    )
    try:
        line = _readline(server, 60.0).strip()
        if not line.isdigit():
            raise FoldtrainError(
                f"Horovod's rendezvous server did not start in {cluster.ns(0)} (see {log_dir / 'rendezvous.log'})"
            )
        port = int(line)
        for slot in slot_plan(hosts, nproc_per_node):
            k = hosts.index(slot.hostname)
            e = {
                **cluster.node_env(k, threads),
                **create_run_env_vars(cluster.addr(0), [cluster.ifname(k)], port),
                **create_slot_env_vars(slot),
                **(env or {}),
            }
            log = log_dir / f"node{k}_rank{slot.rank}.log"
            f = open(log, "w")
            files.append(f)
            logs.append(log)
            procs.append(
                cluster.popen(
                    k, [python, *script_args], {a: str(b) for a, b in e.items()}, stdout=f, stderr=subprocess.STDOUT
                )
            )
        timed_out = wait_all(procs, timeout_s, on_poll)
    finally:
        for p in [*procs, server]:
            if p.poll() is None:
                kill_tree(p, grace_s=2.0)
        for f in files:
            f.close()
    return JobResult([p.returncode for p in procs], logs, time.monotonic() - t0, timed_out)


def serve(hosts: str, nproc_per_node: int) -> int:
    """Horovod's rendezvous server for ``hosts`` (comma list) x ``nproc_per_node``.

    Prints its port, then serves until killed.
    """
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    server.init(slot_plan(hosts.split(","), nproc_per_node))
    print(port, flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        sys.exit("usage: python -m foldtrain.bench.horovod_launch serve HOST[,HOST...] NPROC_PER_NODE")
    sys.exit(serve(sys.argv[2], int(sys.argv[3])))
