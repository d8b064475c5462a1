"""Process trees started by the emulated cluster and the benchmarks: find, wait for, and stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants (children first), from /proc."""
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a process we started and everything it started: SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None and not descendants(proc.pid):
        return
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.05)
    for pid in [*pids, *descendants(proc.pid)]:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def wait_all(procs: list[subprocess.Popen], timeout_s: float, on_poll=None, fail_grace_s: float = 3.0) -> bool:
    """Wait until every process exits; once one fails, give the rest ``fail_grace_s``, then stop them.

    Returns True when the timeout hit (everything still running is stopped)."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if on_poll is not None:
            on_poll()
        if all(c is not None for c in codes):
            return False
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if failed_at is not None and now - failed_at > fail_grace_s:
            for p in procs:
                if p.poll() is None:
                    kill_tree(p)
            return False
        if now > deadline:
            for p in procs:
                if p.poll() is None:
                    kill_tree(p)
            return True
        time.sleep(0.05)
