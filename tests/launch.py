"""torchrun for the tests, its agent and ranks forked from an interpreter that has already imported torch.

A fresh rank spends about 4 CPU-seconds importing torch, its distributed checkpoint and dynamo (which the
first optimizer step imports) before it does anything, and torchrun's agent about 2 more; the suite
launches about 40 runs on two cores. Here both are forks of a warm interpreter, running torchrun's own
code (``torch.distributed.run``: its parser, ``config_from_args``, the elastic agent, its rendezvous and
restarts) with one change: the workers run the script or module as a function in processes the agent
forks (``start_method="fork"``, as torchrun's ``--run-path`` does in a fresh interpreter per worker). The
workers' code, process groups, environment, output and exit codes are what torchrun gives them.

* :func:`run` (``tests.support.torchrun``): the agent is forked from a server that the test session
  starts once (``python -m tests.launch --serve SOCKET``); the call returns a ``CompletedProcess``.
* ``python -m tests.launch TORCHRUN_ARGS``: the same agent in a process of its own, for code that builds
  torchrun's command line itself (the chaos bench's launch, in ``tests/faults/test_chaos.py``).

The tests of torchrun itself (its restarts of fresh interpreters, its signal handling, the docs'
commands) launch the real one.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from foldtrain.hostmem import restart_with_glibc_tunables, with_glibc_tunables

ROOT = Path(__file__).resolve().parents[1]


def worker(*cmd_args: str) -> None:
    """One rank: torchrun's command line (``-u [-m] TARGET ARGV``) run in this forked process, as a fresh
    ``python -u`` would run it. A zero exit returns (the agent waits for every worker's return value: a rank
    must end by returning or ``sys.exit``, as foldtrain's do, not ``os._exit(0)``); any other exit code ends
    the process, and an exception prints its traceback first, as an interpreter would."""
    args = list(cmd_args[1:] if cmd_args[:1] == ("-u",) else cmd_args)
    module = args[0] == "-m"
    target, *argv = args[module:]
    sys.argv = [target, *argv]
    _as_fresh_interpreter()
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python TARGET` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    except KeyboardInterrupt:  # die of SIGINT, as python does (torch's wrapper would exit 0 and the agent wait)
        traceback.print_exc()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        raise


def _as_fresh_interpreter() -> None:
    """What a rank inherits from the agent but a fresh ``python -u`` would not have: the agent's handlers of
    SIGTERM, SIGINT, SIGHUP and SIGQUIT (a rank that torchrun terminates dies of the signal, it does not raise
    in the middle of foldtrain's code), and buffered output (a rank killed with SIGKILL loses nothing)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True))


def preload() -> None:
    """Import what every worker imports, once (after :func:`restart_with_glibc_tunables`: the workers
    inherit this process's allocator settings, and one that found them missing would restart itself)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.run  # noqa: F401

    import foldtrain.cli  # noqa: F401
    import foldtrain.train.trainer  # noqa: F401


def agent(argv: list[str]) -> None:
    """torchrun's ``main(argv)``, its workers forked from this process and running :func:`worker`."""
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    def forked(config, entrypoint):  # torchrun's launch of `python`, as forks running `worker`
        config.start_method = "fork"
        return elastic_launch(config, worker)

    torchrun.elastic_launch = forked
    torchrun.main(argv)


# ---------------------------------------------------------------------------------------------- the server
def _agent_exit_code(argv: list[str]) -> int:
    """Run :func:`agent` as a process's whole life would: its exit code (an exception: its traceback, 1)."""
    try:
        agent(argv)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def _start_agent(req: dict, conn: socket.socket) -> int:
    """Fork the agent of request ``req`` (a process group of its own, its output into the request's files)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(conn.detach())  # the monitor's end only: the client sees the end of the connection if it dies
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(with_glibc_tunables(req["env"]) or req["env"])
        paths = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = paths  # as a fresh interpreter would have them (the rest is this one's)
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)  # only 0, 1 and 2 reach the ranks, as with a subprocess
        sys.argv = [sys.executable, *req["argv"]]
        code = _agent_exit_code(req["argv"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(conn: socket.socket) -> None:
    """In a forked monitor: read a request, start its agent, send its pid, wait, send its exit code."""
    with conn, conn.makefile("rw") as f:
        req = json.loads(f.readline())
        pid = _start_agent(req, conn)
        f.write(json.dumps({"pid": pid}) + "\n")
        f.flush()
        _, status = os.waitpid(pid, 0)
        f.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        f.flush()


def serve(path: str) -> None:
    """Answer requests on the Unix socket ``path``, each in a forked monitor, until stdin closes (the test
    session has ended)."""
    restart_with_glibc_tunables()
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in readable:
            return
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the monitor and the agent wait for their children
            try:
                _answer(conn)
            finally:
                os._exit(0)
        conn.close()


# ---------------------------------------------------------------------------------------------- the client
_SERVER: dict = {}


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch: this one with one OpenMP thread, this checkout first on the path, nothing
    of an enclosing torchrun (``TORCHELASTIC_*``) or fault injection (``FOLDTRAIN_FAULT``), and ``extra``."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "FOLDTRAIN_FAULT"))}
    return {
        **inherited,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(extra or {}),
    }


def _server_path() -> str:
    """The running server's socket (started at the first call of the session, ended with it)."""
    if "path" not in _SERVER:
        tmp = tempfile.mkdtemp(prefix="ft-launch-")
        path = os.path.join(tmp, "socket")
        env = launch_env()
        env.pop("PYTHONUNBUFFERED", None)  # the ranks unbuffer their own output (tests/test_launch.py checks it)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.launch", "--serve", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests.launch: the server did not start (exit {proc.wait()})")

        def stop():
            proc.stdin.close()  # the server's signal to end
            proc.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)

        atexit.register(stop)
        _SERVER["path"] = path
    return _SERVER["path"]


def _kill_group(pid: int) -> None:
    """SIGKILL the agent ``pid`` and every rank it started (its process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(argv: list[str], env: dict[str, str], cwd: str | Path, timeout: float) -> subprocess.CompletedProcess:
    """``torchrun ARGV`` (torchrun's arguments, then the script's) as the forked agent of the session's
    server: its exit code and output, as ``subprocess.run(capture_output=True, text=True)`` gives them (a
    launch past ``timeout`` is killed with its workers and raises ``TimeoutExpired``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
    with tempfile.TemporaryDirectory(prefix="ft-launch-out-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        req = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, s.makefile("rw") as f:
            s.connect(_server_path())
            f.write(json.dumps(req) + "\n")
            f.flush()
            s.settimeout(60)  # a fork: the pid comes at once
            pid = json.loads(f.readline())["pid"]
            s.settimeout(max(timeout, 0.001))
            try:
                line = f.readline()
            except TimeoutError:
                _kill_group(pid)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text()) from None
            except BaseException:  # the test's own time limit, ^C: nothing of the launch outlives the call
                _kill_group(pid)
                raise
            if not line:
                _kill_group(pid)
                raise RuntimeError(
                    f"tests.launch: the launch's monitor ended without its exit code:\n{err.read_text()}"
                )
            code = json.loads(line)["returncode"]
        return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        restart_with_glibc_tunables()
        preload()
        agent(sys.argv[1:])
