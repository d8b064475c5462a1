"""An emulated slow network on one machine: Linux network namespaces as "nodes".

``EmulatedCluster(n_nodes, rate="1gbit")`` builds, in the root namespace, one Linux bridge
``<prefix>-br`` (a switch) and, per node ``k``:

* a network namespace ``<prefix>-n<k>`` with ``lo`` up;
* a veth pair: ``<prefix>-v<k>`` inside the namespace (the node's NIC, address
  ``198.18.0.<k+1>/24`` from the RFC 2544 benchmarking range 198.18.0.0/15) and ``<prefix>-h<k>``
  in the root namespace, enslaved to the bridge;
* a ``tbf`` token-bucket shaper at ``rate`` on the egress of *both* ends, so the node's upload
  (namespace side) and download (bridge side) are each limited to ``rate``: a full-duplex NIC of
  that speed behind a non-blocking switch. ``delay_ms`` > 0 adds a ``netem`` delay on the
  node's egress (one-way latency between two nodes = ``delay_ms``; needs ``sch_netem``).

Traffic between two processes of the same node goes over the namespace's own address (the
kernel's loopback path) and is not shaped; traffic between nodes crosses two shaped links.

As on a real cluster, the machine's host name resolves, inside node ``k``, to the node's own
address: ``/etc/netns/<prefix>-n<k>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``.
(Horovod's gloo finds its address for process sets by host name, whatever ``HOROVOD_GLOO_IFACE``
says.)

Teardown (namespaces, their processes, veths, bridge) always runs: on normal exit, on an
exception, on SIGINT/SIGTERM/SIGHUP (handlers installed while the cluster lives) and at
interpreter exit. Leftovers of a crashed earlier cluster with the same prefix are removed at
start; an ``flock`` on ``/run/foldtrain-netns/<prefix>.lock`` keeps two live clusters from using
the same prefix (and tells a live cluster's leftovers-to-be from a crashed one's).

Needs root and iproute2 (``ip``, ``tc``); otherwise :class:`~foldtrain.errors.FoldtrainError`
with one line (:data:`NEEDS_ROOT`).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from foldtrain.errors import FoldtrainError
from foldtrain.netem.procs import _alive, kill_tree, wait_all

NEEDS_ROOT = (
    "the emulated network needs root and iproute2 (ip, tc): run as root, or `apt-get install iproute2`; "
    "skipping the throttled comparison"
)
SUBNET = "198.18.0"  # RFC 2544 benchmarking range (198.18.0.0/15); node k = 198.18.0.(k+1)/24
LOCK_DIR = Path("/run/foldtrain-netns")
NETNS_ETC = Path("/etc/netns")  # per-namespace files `ip netns exec` mounts over /etc
NETCHECK = Path(__file__).with_name("netcheck.py")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
# tc's units: "bps" means bytes per second
_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def parse_rate(rate: str) -> int:
    """A tc rate ("1gbit", "100mbit", "12.5mbps", "1e9bit") in bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(rate).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise FoldtrainError(f"network rate '{rate}' is not a rate; write e.g. 1gbit, 100mbit or 500kbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_rate(bits: int) -> str:
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= f and bits % f == 0:
            return f"{bits // int(f)}{unit}"
    return f"{bits}bit"


# tbf's queue: the most a packet waits in the shaper (excess is dropped). A bulk TCP transfer keeps it full, so a
# small message sent meanwhile (a loss all-reduce) waits behind up to this much of it (the simulator's inter.queue_ms)
QUEUE_MS = 50


def tbf_burst_bytes(bits_per_s: int) -> int:
    """Token-bucket depth: 5 ms at the rate, at least 32 KiB (several full-size packets)."""
    return max(32 * 1024, bits_per_s // 8 // 200)


def _run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise FoldtrainError(f"`{' '.join(argv)}` failed: {msg[-1] if msg else f'exit {p.returncode}'}")
    return p


def check_prerequisites() -> None:
    """Raise FoldtrainError(NEEDS_ROOT) unless we are root with working ``ip netns`` and ``tc``."""
    if sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise FoldtrainError(NEEDS_ROOT)
    try:
        if subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10).returncode != 0:
            raise FoldtrainError(NEEDS_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        raise FoldtrainError(NEEDS_ROOT) from None


# ---------------------------------------------------------------- the cluster


@dataclass
class JobResult:
    """The outcome of a multi-node launch: per-node exit codes and logs."""

    returncodes: list[int | None]
    logs: list[Path]
    wall_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.is_file())


@dataclass
class EmulatedCluster:
    """``with EmulatedCluster(2, "100mbit") as c: subprocess.run(c.node_cmd(0, [...]))`` (see module doc)."""

    n_nodes: int
    rate: str = "1gbit"
    delay_ms: float = 0.0
    name_prefix: str = "ft"
    _lock_fd: int | None = field(default=None, init=False, repr=False)
    _old_handlers: dict = field(default_factory=dict, init=False, repr=False)
    _up: bool = field(default=False, init=False, repr=False)
    _procs: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.n_nodes <= 200:
            raise FoldtrainError(f"an emulated cluster has 1 to 200 nodes, got {self.n_nodes}")
        if not _PREFIX_RE.match(self.name_prefix):
            raise FoldtrainError(
                f"name_prefix '{self.name_prefix}' must be 1-10 lowercase letters/digits starting with a letter"
            )
        if self.delay_ms < 0:
            raise FoldtrainError(f"delay_ms must be >= 0, got {self.delay_ms}")
        self.rate_bits = parse_rate(self.rate)

    # ------------------------------------------------------------ names
    def ns(self, k: int) -> str:
        return f"{self.name_prefix}-n{k}"

    def ifname(self, k: int) -> str:
        """The node's NIC inside its namespace (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
        return f"{self.name_prefix}-v{k}"

    def host_ifname(self, k: int) -> str:
        """The bridge-side end of node k's link, in the root namespace."""
        return f"{self.name_prefix}-h{k}"

    @property
    def bridge(self) -> str:
        return f"{self.name_prefix}-br"

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        check_prerequisites()
        self._lock()
        self._install_handlers()
        atexit.register(self.close)
        try:
            cleanup_prefix(self.name_prefix)
            self._up = True
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _lock(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        path = LOCK_DIR / f"{self.name_prefix}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FoldtrainError(
                f"an emulated cluster with prefix '{self.name_prefix}' is in use by process {owner}; "
                "wait for it or pass another prefix"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers.clear()

    def _tc_args(self, dev: str, with_delay: bool) -> list[list[str]]:
        rate = f"{self.rate_bits}bit"
        tbf = ["tbf", "rate", rate, "burst", str(tbf_burst_bytes(self.rate_bits)), "latency", f"{QUEUE_MS}ms"]
        if with_delay and self.delay_ms > 0:
            return [
                ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"],
                ["tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
            ]
        return [["tc", "qdisc", "replace", "dev", dev, "root", *tbf]]

    def _build(self) -> None:
        br = self.bridge
        _run(["ip", "link", "add", br, "type", "bridge"])
        _disable_ipv6(br)
        _run(["ip", "link", "set", br, "up"])
        for k in range(self.n_nodes):
            ns, v, h = self.ns(k), self.ifname(k), self.host_ifname(k)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", h, "type", "veth", "peer", "name", v, "netns", ns])
            _disable_ipv6(h)
            _run(["ip", "link", "set", h, "master", br])
            _run(["ip", "link", "set", h, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", v])
            _run(["ip", "-n", ns, "link", "set", v, "up"])
            _write_hosts(ns, self.addr(k))
            for argv in self._tc_args(v, with_delay=True):
                p = _run(["ip", "netns", "exec", ns, *argv], check=False)
                if p.returncode != 0:
                    if "netem" in argv:
                        raise FoldtrainError(
                            "netem (sch_netem) is not available in this kernel; run with delay 0 (--delay_ms 0)"
                        )
                    raise FoldtrainError(f"tc could not shape {v} in {ns}: {(p.stderr or p.stdout).strip()}")
            for argv in self._tc_args(h, with_delay=False):
                _run(argv)

    def set_rate(self, rate: str) -> None:
        """Change the shaping of every link in place."""
        self.rate_bits = parse_rate(rate)
        self.rate = rate
        for k in range(self.n_nodes):
            for argv in self._tc_args(self.ifname(k), with_delay=True):
                _run(["ip", "netns", "exec", self.ns(k), *argv])
            for argv in self._tc_args(self.host_ifname(k), with_delay=False):
                _run(argv)

    def close(self) -> None:
        """Stop processes started in the nodes, delete namespaces, veths and bridge (idempotent).

        SIGINT/SIGTERM/SIGHUP are held back while it runs (a second Ctrl-C cannot interrupt the
        teardown) and delivered afterwards."""
        masked = threading.current_thread() is threading.main_thread()
        sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        if masked:
            signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        try:
            for p in self._procs:
                if p.poll() is None:
                    kill_tree(p, grace_s=2.0)
            self._procs.clear()
            if self._up:
                cleanup_prefix(self.name_prefix)
                self._up = False
        finally:
            self._restore_handlers()
            if self._lock_fd is not None:
                try:
                    os.close(self._lock_fd)  # the lock file stays (unlinking it could race with a new owner)
                except OSError:
                    pass
                self._lock_fd = None
            try:
                atexit.unregister(self.close)
            except Exception:
                pass
            if masked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

    # ------------------------------------------------------------ running things in nodes
    def node_cmd(self, k: int, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` wrapped to run inside node ``k`` (with extra environment variables ``env``)."""
        if not 0 <= k < self.n_nodes:
            raise FoldtrainError(f"node {k} does not exist (the cluster has {self.n_nodes})")
        pairs = [f"{a}={b}" for a, b in (env or {}).items()]
        return ["ip", "netns", "exec", self.ns(k), "env", *pairs, *argv]

    def node_env(self, k: int, threads: int = 1) -> dict[str, str]:
        """Environment for a distributed process on node ``k``: its NIC for gloo and NCCL, thread count.

        For NCCL, ``NCCL_HOSTID`` makes each node a host of its own (so ranks of different nodes
        talk over the sockets of the shaped links, not shared memory or P2P) and InfiniBand is off."""
        return {
            "GLOO_SOCKET_IFNAME": self.ifname(k),
            "NCCL_SOCKET_IFNAME": self.ifname(k),
            "NCCL_HOSTID": self.ns(k),
            "NCCL_IB_DISABLE": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        }

    def popen(self, k: int, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` in node ``k`` (own session); it is stopped at teardown if still running."""
        p = subprocess.Popen(self.node_cmd(k, argv, env), start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def link_bytes(self, k: int) -> tuple[int, int]:
        """(bytes node k sent, bytes node k received) on its link so far, from the bridge-side counters."""
        base = Path("/sys/class/net") / self.host_ifname(k) / "statistics"
        return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())

    def run_torchrun(
        self,
        script_args: list[str],
        nproc_per_node: int = 1,
        nnodes: int | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        threads: int = 1,
        timeout_s: float = 600.0,
        log_dir: str | Path | None = None,
        python: str = sys.executable,
        on_poll=None,
        gpus: int = 0,
    ) -> JobResult:
        """Run one torchrun per node (``--nnodes N --node_rank k --master_addr <node 0>``) and wait for all.

        ``script_args`` is what follows torchrun's options, e.g. ``["-m", "foldtrain", "train", ...]``
        or ``["anchor.py", ...]``. Each node's output goes to ``log_dir/node<k>.log``. When any node
        fails, the others get 3 s to fail on their own, then everything is stopped; the same on
        timeout. ``on_poll()`` (optional) is called about every 50 ms while the job runs. With
        ``gpus`` > 0, node k sees GPUs ``k*nproc .. k*nproc+nproc-1`` (modulo ``gpus``) as its own.
        """
        n = nnodes or self.n_nodes
        if not 1 <= n <= self.n_nodes:
            raise FoldtrainError(f"the job wants {n} nodes but the cluster has {self.n_nodes}")
        port = port or _free_port_hint()
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="ft-job-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        procs, logs, files = [], [], []
        t0 = time.monotonic()
        try:
            for k in range(n):
                argv = [
                    python,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(n),
                    "--node_rank",
                    str(k),
                    "--nproc_per_node",
                    str(nproc_per_node),
                    "--master_addr",
                    self.master_addr,
                    "--master_port",
                    str(port),
                    *script_args,
                ]
                e = {**self.node_env(k, threads), **(env or {})}
                if gpus > 0:
                    e["CUDA_VISIBLE_DEVICES"] = ",".join(
                        str((k * nproc_per_node + i) % gpus) for i in range(nproc_per_node)
                    )
                log = log_dir / f"node{k}.log"
                f = open(log, "w")
                files.append(f)
                logs.append(log)
                procs.append(self.popen(k, argv, e, stdout=f, stderr=subprocess.STDOUT, cwd=os.getcwd()))
            timed_out = wait_all(procs, timeout_s, on_poll)
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_tree(p)
            for f in files:
                f.close()
        return JobResult([p.returncode for p in procs], logs, time.monotonic() - t0, timed_out)

    # ------------------------------------------------------------ self-checks
    def ping(self, src: int = 0, dst: int = 1, timeout_s: float = 10.0) -> float:
        """Round-trip seconds of a small TCP echo from node ``src`` to node ``dst`` (raises if unreachable)."""
        res = self._pair(src, dst, ["echo-server"], ["echo-client"], timeout_s)
        return float(res["rtt_s"])

    def measure_throughput(self, src: int = 0, dst: int = 1, nbytes: int | None = None, max_s: float = 5.0) -> float:
        """Bytes per second of one TCP stream from node ``src`` to node ``dst`` (bounded bytes and time).

        ``nbytes`` defaults to ~0.5 s worth at the configured rate (1 MiB to 64 MiB).
        """
        if nbytes is None:
            nbytes = int(min(64 << 20, max(1 << 20, self.rate_bits / 8 * 0.5)))
        res = self._pair(
            src,
            dst,
            ["recv", "--max-s", str(max_s)],
            ["send", "--bytes", str(nbytes), "--max-s", str(max_s)],
            max_s + 15,
        )
        return res["bytes"] / max(res["seconds"], 1e-9)

    def _pair(self, src: int, dst: int, server_args: list[str], client_args: list[str], timeout_s: float) -> dict:
        port = 40000 + (os.getpid() % 20000)
        py = [sys.executable, str(NETCHECK)]
        server = self.popen(
            dst,
            [*py, *server_args, "--host", self.addr(dst), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = _readline(server, timeout_s)
            if line.strip() != "ready":
                raise FoldtrainError(
                    f"network self-check: the server in {self.ns(dst)} did not start "
                    f"({line.strip() or server.stderr.read().strip()})"
                )
            client = subprocess.run(
                self.node_cmd(src, [*py, *client_args, "--host", self.addr(dst), "--port", str(port)]),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if client.returncode != 0:
                raise FoldtrainError(
                    f"network self-check: {self.ns(src)} could not reach {self.addr(dst)}: "
                    f"{(client.stderr or client.stdout).strip().splitlines()[-1:]}"
                )
            out, err = server.communicate(timeout=timeout_s)
            result = json.loads(client.stdout.strip().splitlines()[-1])
            if out.strip():
                result.update(json.loads(out.strip().splitlines()[-1]))
            return result
        finally:
            if server.poll() is None:
                kill_tree(server, grace_s=1.0)


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else ""


def _disable_ipv6(dev: str) -> None:
    """No IPv6 autoconfiguration chatter on our links (best effort)."""
    try:
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1")
    except OSError:
        pass


def _write_hosts(ns: str, addr: str) -> None:
    """Inside ``ns``, this machine's host name resolves to ``addr`` (its node's address)."""
    d = NETNS_ETC / ns
    d.mkdir(parents=True, exist_ok=True)
    (d / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{addr}\t{socket.gethostname()}\n")


def _free_port_hint() -> int:
    import random

    return random.randint(20000, 39999)


def list_prefix(prefix: str) -> tuple[list[str], list[str]]:
    """(namespaces, root-namespace links) that belong to clusters with this prefix."""
    ns_re = re.compile(rf"^{re.escape(prefix)}-n\d+$")
    link_re = re.compile(rf"^{re.escape(prefix)}-(br|h\d+)$")
    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in ns_out.splitlines() if line.strip()]
    link_out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    links = []
    for line in link_out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if link_re.match(name):
                links.append(name)
    return [n for n in names if ns_re.match(n)], links


def cleanup_prefix(prefix: str) -> None:
    """Delete every namespace (after stopping its processes), veth and bridge named with ``prefix``."""
    namespaces, _ = list_prefix(prefix)
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [int(p) for p in pids if p.isdigit() and _alive(int(p))]
            for pid in live:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            t_end = time.monotonic() + 2.0
            while live and time.monotonic() < t_end and any(_alive(p) for p in live):
                time.sleep(0.05)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for d in NETNS_ETC.glob(f"{prefix}-n*") if NETNS_ETC.is_dir() else []:
        if re.fullmatch(rf"{re.escape(prefix)}-n\d+", d.name):
            shutil.rmtree(d, ignore_errors=True)
    _, links = list_prefix(prefix)
    for link in sorted(links, key=lambda n: n.endswith("-br")):  # veths first, the bridge last
        subprocess.run(["ip", "link", "del", link], capture_output=True)
