"""User-facing errors: one clear line naming the problem and the fix.

Anything raised as a ``FoldtrainError`` is printed (by :func:`report`, once) as a single line
``foldtrain: error: ...`` and the process exits with status 2, before any
process group is created where possible.
"""

import sys


class FoldtrainError(Exception):
    """A problem the user can fix; its message names the problem and the fix."""

    reported = False


def report(e: FoldtrainError) -> None:
    """Print ``e``'s line to stderr, once: a failing run says why before it tears down its process group,
    because the launcher may end the process during that teardown (torchrun signals the survivors of a dead
    rank) and the CLI's own report would then never be printed."""
    if not e.reported:
        print(f"foldtrain: error: {e}", file=sys.stderr, flush=True)
        e.reported = True


class ConfigError(FoldtrainError):
    """An invalid configuration value or key."""


class DataError(FoldtrainError):
    """Missing, empty, truncated or corrupt data."""


class CheckpointError(FoldtrainError):
    """A missing or corrupt checkpoint."""


class DistributedError(FoldtrainError):
    """A rank died, stalled or the launch is inconsistent."""


# Exit codes of `foldtrain train` besides 0 (finished) and 2 (a FoldtrainError):
EXIT_PREEMPTED = 75  # stopped by --checkpoint.signals after saving a checkpoint of the last step; --resume continues
EXIT_PREEMPT_ABORTED = 76  # a second signal or --checkpoint.signal_timeout_s: ended without that save
