"""gloo latency, bandwidth and CPU time per byte: on loopback and across emulated nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from foldtrain.errors import FoldtrainError


def _comm_probe() -> None:
    """Run under torchrun: prints one JSON line on rank 0."""
    import torch
    import torch.distributed as dist

    from foldtrain import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    one = torch.zeros(1)
    lat = []
    for i in range(40):
        dist.barrier() if i == 0 else None
        t0 = time.perf_counter()
        if r == 0:
            collectives.send(one, 1)
            collectives.recv(one, 1)
        elif r == 1:
            collectives.recv(one, 0)
            collectives.send(one, 0)
        lat.append((time.perf_counter() - t0) / 2)
    big = torch.zeros(4 * 2**20)  # 16 MB
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        if r == 0:
            collectives.send(big, 1)
        elif r == 1:
            collectives.recv(big, 0)
    dist.barrier()
    p2p = 3 * big.numel() * 4 / (time.perf_counter() - t0)
    collectives.all_reduce(big)
    dist.barrier()
    import resource

    def cpu() -> float:  # this process's CPU time, every thread (gloo's included)
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    for _ in range(3):
        collectives.all_reduce(big)
    ar_t = (time.perf_counter() - t0) / 3
    sent = 2 * (w - 1) / w * big.numel() * 4
    cpu_per_byte = (cpu() - c0) / (3 * sent)
    ar_bw = sent / ar_t
    # one step of a collective with every rank communicating: a 4 KB all-reduce is 2 (w-1) steps of latency.
    # On cores shared by more processes than cores it is 10-15x the ping-pong above (4 ranks on 2 cores:
    # 7.6 ms per all-reduce, 1.3 ms a step, against 0.04-0.09 ms one way), and every collective pays it.
    # Also the CPU a step takes (each rank's, its gloo threads' included): on shared cores it is much of
    # the step (4 ranks on 2 cores: 0.36 ms of a 1.1-1.3 ms step), and a collective launched during a
    # backward takes it from that backward.
    small = torch.zeros(1024)
    dist.barrier()
    steps = []
    c0 = cpu()
    for _ in range(40):
        t0 = time.perf_counter()
        collectives.all_reduce(small)
        steps.append((time.perf_counter() - t0) / (2 * (w - 1)))
    step_cpu = (cpu() - c0) / (40 * 2 * (w - 1))
    steps.sort()
    if r == 0:
        lat.sort()
        result = {
            "latency_s": lat[len(lat) // 2],
            "p2p_bw": p2p,
            "allreduce_bw": ar_bw,
            "world": w,
            "cpu_per_byte": cpu_per_byte,
            "collective_latency_s": steps[len(steps) // 2],
            "collective_cpu_s": step_cpu,
        }
        print("CALIBRATE " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _parse(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("CALIBRATE "):
            return json.loads(line[len("CALIBRATE ") :])
    raise FoldtrainError(f"calibrate: the communication probe printed no result; its output ends with: {text[-300:]!r}")


def measure_loopback(ranks: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(max(ranks, 2)),
        "-m",
        "foldtrain.calibrate",
        "--_comm_probe",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0:
        raise FoldtrainError(
            f"calibrate: the loopback communication probe failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
        )
    return _parse(p.stdout)


def measure_network(rate: str, nodes: int) -> dict:
    from foldtrain.netem.cluster import EmulatedCluster

    with EmulatedCluster(nodes, rate, name_prefix="ftcal") as c:
        log = tempfile.mkdtemp(prefix="ft-cal-")
        job = c.run_torchrun(
            ["-m", "foldtrain.calibrate", "--_comm_probe"], nproc_per_node=1, timeout_s=300, log_dir=log
        )
        if not job.ok:
            raise FoldtrainError(f"calibrate: the communication probe across emulated nodes failed (logs in {log})")
        return _parse(job.text())


def links(loop: dict, net: dict | None, hop: float | None = None):
    """This machine's ``(intra, inter)`` links from the probes above: loopback, and the emulated network
    when measured (else the same link). ``hop``: a collective's step measured with the runs' number of
    processes (default: the loopback probe's); across nodes never shorter than that, since with more
    processes than cores the host's scheduling, not the wire, is most of a step (the network probe has 2).
    Probes from before the step was measured have none (0: the point-to-point latency). The emulated network's
    interface queues up to its shaper's latency (:data:`~foldtrain.netem.cluster.QUEUE_MS`) ahead of a message."""
    from foldtrain.netem.cluster import QUEUE_MS
    from foldtrain.sim.cluster import Link

    hop = loop.get("collective_latency_s", 0.0) if hop is None else hop
    # gloo's reduce_scatter_tensor (FSDP2's) is an all-reduce of the whole input, then this rank's chunk
    # (ProcessGroupGloo, pytorch/pytorch#118911): twice a ring reduce-scatter's bytes, half its bus bandwidth
    intra = Link(
        loop["allreduce_bw"], loop["latency_s"], hop, p2p_bw=loop.get("p2p_bw", 0.0), rs_bw=loop["allreduce_bw"] / 2
    )
    inter = (
        Link(
            net["allreduce_bw"],
            net["latency_s"],
            max(net.get("collective_latency_s", 0.0), hop),
            p2p_bw=net.get("p2p_bw", 0.0),
            rs_bw=net["allreduce_bw"] / 2,
            queue=QUEUE_MS / 1e3,
        )
        if net
        else intra
    )
    return intra, inter


def check_network_prerequisites() -> None:
    from foldtrain.netem import cluster as netns

    try:
        netns.check_prerequisites()
    except FoldtrainError:
        raise FoldtrainError(
            "calibrate --network emulates nodes with network namespaces and needs root and iproute2 (ip, tc): "
            "run as root and `apt-get install -y iproute2`, or drop --network to measure this machine only"
        ) from None
