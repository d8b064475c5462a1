"""The tests' torchrun (``tests/launch.py``) gives back what torchrun would: each rank's output, a failed
rank's exit code in the agent's summary and the launch's own code 1, a rank dead of a signal; and a launch
past its time limit is killed with every rank it started."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time

import pytest

from tests import launch
from tests.support import ROOT, launch_env


def run(tmp_path, body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    return launch.run(["--standalone", "--nproc-per-node", "2", str(script)], launch_env(), ROOT, timeout)


def test_output_and_a_zero_exit_of_ranks_as_python_u_starts_them(tmp_path):
    r = run(
        tmp_path,
        """
        import os, signal, sys
        term, intr = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        handlers = term == signal.SIG_DFL and intr is signal.default_int_handler
        unbuffered = all(type(s.buffer).__name__ == "FileIO" and s.write_through for s in (sys.stdout, sys.stderr))
        print("rank", os.environ["RANK"], handlers, unbuffered)
        print("err", file=sys.stderr)
    """,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(r.stdout.split("\n")[:2]) == ["rank 0 True True", "rank 1 True True"]
    assert r.stderr.count("err\n") == 2


@pytest.mark.parametrize(
    "ending,exitcode",
    [("sys.exit(3)", "3"), ("os.kill(os.getpid(), signal.SIGKILL)", "-9"), ("raise KeyboardInterrupt", "-2")],
)
def test_a_rank_that_fails_fails_the_launch(tmp_path, ending, exitcode):
    r = run(
        tmp_path,
        f"""
        import os, signal, sys, time
        print("before")  # not flushed by the script: a rank's output is unbuffered, as with python -u
        if os.environ["RANK"] == "1":
            {ending}
        time.sleep(2)
    """,
    )
    assert r.returncode == 1
    assert f"exitcode: {exitcode}" in r.stderr, r.stderr[-2000:]
    assert r.stdout.count("before") == 2


def test_a_launch_past_its_time_is_killed_with_its_ranks(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        run(
            tmp_path,
            f"""
            import os, time
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(120)
        """,
            timeout=5,
        )
    ranks = [int(p) for p in pids.read_text().split()]
    assert len(ranks) == 2
    assert all(gone(pid) for pid in ranks)


def gone(pid: int, within_s: float = 10) -> bool:
    """Whether process ``pid`` no longer exists (killed and reaped) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
