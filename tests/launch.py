"""torchrun for the tests, each rank forked from one interpreter that has already imported torch.

``python -m tests.launch TORCHRUN_ARGS`` takes torchrun's arguments and runs torchrun's own code (its
parser, ``config_from_args`` and the elastic agent, which ``torch.distributed.run`` uses), with one
change: the workers run the script or module as a function in processes forked from this one
(``start_method="fork"``, as torchrun's ``--run-path`` does with a fresh interpreter per worker) instead
of exec'ing ``python`` each. A fresh rank spends about 4 CPU-seconds importing torch, its distributed
checkpoint and dynamo (which the first optimizer step imports) before it does anything; the suite starts
about 250 ranks on two cores. The workers' code, process groups, environment and exit codes are what
torchrun gives them; the tests of torchrun itself (kills, restarts, the launcher's own messages) launch
the real one (``tests.support.torchrun(..., fork=False)``).
"""

from __future__ import annotations

import os
import runpy
import sys

from foldtrain.hostmem import restart_with_glibc_tunables


def worker(*cmd_args: str) -> None:
    """One rank: torchrun's command line (``-u [-m] TARGET ARGV``) run in this forked process. A zero exit
    returns (the agent waits for every worker's return value); any other exit code ends the process."""
    args = list(cmd_args[1:] if cmd_args[:1] == ("-u",) else cmd_args)
    module = args[0] == "-m"
    target, *argv = args[module:]
    sys.argv = [target, *argv]
    for stream in (sys.stdout, sys.stderr):  # torchrun runs `python -u`: nothing is lost when a rank is killed
        stream.reconfigure(write_through=True)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python TARGET` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def main(argv: list[str]) -> None:
    # First, as foldtrain's command does: the workers inherit this process's allocator settings, and a
    # worker that found them missing would restart itself as this launcher.
    restart_with_glibc_tunables()
    import torch._dynamo  # noqa: F401  (what every worker imports, once, here)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    import foldtrain.cli  # noqa: F401
    import foldtrain.train.trainer  # noqa: F401

    def forked(config, entrypoint):  # torchrun's launch of `python`, as forks of this process running `worker`
        config.start_method = "fork"
        return elastic_launch(config, worker)

    torchrun.elastic_launch = forked
    torchrun.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
