"""Process trees: ``wait_all`` stops the rest of a launch when one process fails, and on a timeout."""

from __future__ import annotations

import subprocess
import sys
import time

from foldtrain.netem.procs import wait_all


def test_wait_all_stops_the_rest_when_one_fails():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    t0 = time.monotonic()
    assert wait_all([sleeper, failing], timeout_s=60, fail_grace_s=0.5) is False
    assert time.monotonic() - t0 < 20
    assert failing.returncode == 3 and sleeper.returncode is not None and sleeper.returncode != 0
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert wait_all([slow], timeout_s=0.5) is True and slow.returncode is not None
