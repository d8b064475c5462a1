"""foldtrain's glibc tunables: the command restarts itself once with them, keeping what the user set."""

import os
import subprocess
import sys

import pytest

from foldtrain.hostmem import GLIBC_TUNABLES, _glibc, with_glibc_tunables

_PROBE = """
import os
from foldtrain.hostmem import restart_with_glibc_tunables
print(os.getpid(), os.environ.get("GLIBC_TUNABLES", "-"), flush=True)
restart_with_glibc_tunables()
"""


def test_tunables_are_added_to_what_the_environment_sets():
    env = with_glibc_tunables({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3:glibc.mem.tagging=0", "X": "1"})
    assert env["X"] == "1"
    assert env["GLIBC_TUNABLES"].split(":") == [
        "glibc.malloc.tcache_count=3",  # the user's value wins
        "glibc.mem.tagging=0",
        "glibc.malloc.arena_max=1",
    ]
    assert with_glibc_tunables(env) is None  # nothing left to add: no second restart
    assert with_glibc_tunables({})["GLIBC_TUNABLES"] == ":".join(f"{k}={v}" for k, v in GLIBC_TUNABLES.items())


def _run(**env) -> list[list[str]]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "FOLDTRAIN_GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return [line.split() for line in out.stdout.splitlines()]


@pytest.mark.skipif(not _glibc() or os.path.exists("/dev/nvidiactl"), reason="restarts on CPU-only glibc machines")
def test_the_process_restarts_once_in_place_with_the_tunables():
    (pid0, before), (pid1, after) = _run()
    assert before == "-" and pid1 == pid0  # the same process: torchrun keeps watching the pid it started
    assert set(after.split(":")) == {f"{k}={v}" for k, v in GLIBC_TUNABLES.items()}
    assert len(_run(GLIBC_TUNABLES=after)) == 1  # already started with them: no restart
    assert len(_run(FOLDTRAIN_GLIBC_TUNABLES="0")) == 1  # opted out
