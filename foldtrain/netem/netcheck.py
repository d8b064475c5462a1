"""Tiny TCP tools for checking an emulated network (standard library only; run as a script).

    python netcheck.py recv --host IP --port P [--max-s 5]         # prints "ready", then JSON {bytes, seconds}
    python netcheck.py send --host IP --port P --bytes N [--max-s 5]
    python netcheck.py echo-server --host IP --port P              # echoes one message, then exits
    python netcheck.py echo-client --host IP --port P              # prints JSON {rtt_s}

Everything is bounded: the sender stops after ``--bytes`` or ``--max-s`` seconds, the receiver
and echo server give up after ``--max-s`` (default 10 s) without a peer. The receiver's clock
runs from the first byte to the end of the stream.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 64 * 1024


def _listen(host: str, port: int, max_s: float) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1)
    s.settimeout(max_s)
    print("ready", flush=True)
    return s


def recv(host: str, port: int, max_s: float) -> dict:
    with _listen(host, port, max_s + 5) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(max_s + 5)
            total, t_first = 0, None
            while True:
                data = conn.recv(CHUNK)
                if not data:
                    break
                if t_first is None:
                    t_first = time.perf_counter()
                    first = len(data)
                total += len(data)
            t_end = time.perf_counter()
    if t_first is None:
        return {"bytes": 0, "seconds": 0.0}
    # the first chunk arrived at t_first: count the bytes after it over the time after it
    return {"bytes": total - first, "seconds": max(t_end - t_first, 1e-9), "total_bytes": total}


def send(host: str, port: int, nbytes: int, max_s: float) -> dict:
    buf = b"\0" * CHUNK
    with socket.create_connection((host, port), timeout=max_s + 5) as s:
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes and time.perf_counter() - t0 < max_s:
            sent += s.send(buf[: min(CHUNK, nbytes - sent)])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # wait for the receiver to close: the data is delivered
    return {"sent": sent, "send_seconds": time.perf_counter() - t0}


def echo_server(host: str, port: int, max_s: float) -> dict:
    with _listen(host, port, max_s) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(max_s)
            data = conn.recv(1024)
            conn.sendall(data)
    return {"echoed": len(data)}


def echo_client(host: str, port: int, max_s: float) -> dict:
    msg = b"foldtrain-netcheck"
    with socket.create_connection((host, port), timeout=max_s) as s:
        t0 = time.perf_counter()
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            part = s.recv(1024)
            if not part:
                break
            got += part
        rtt = time.perf_counter() - t0
    if got != msg:
        raise SystemExit(f"echo mismatch: sent {msg!r}, got {got!r}")
    return {"rtt_s": rtt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["recv", "send", "echo-server", "echo-client"])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bytes", type=int, default=8 << 20)
    p.add_argument("--max-s", type=float, default=10.0)
    a = p.parse_args(argv)
    if a.mode == "recv":
        out = recv(a.host, a.port, a.max_s)
    elif a.mode == "send":
        out = send(a.host, a.port, a.bytes, a.max_s)
    elif a.mode == "echo-server":
        out = echo_server(a.host, a.port, a.max_s)
    else:
        out = echo_client(a.host, a.port, a.max_s)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
