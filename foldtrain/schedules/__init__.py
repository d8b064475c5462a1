"""Pipeline schedules as data: per-rank action lists, torch-free.

>>> from foldtrain.schedules import build_schedule, format_schedule
>>> print(format_schedule(build_schedule("fold", 2, 2, 2)))  # doctest: +NORMALIZE_WHITESPACE
fold: pp=2 virtual=2 microbatches=2 dp_sync=after-flush
rank 0: F(c0,m0) F(c0,m1) F(c2,m0) F(c2,m1) B(c2,m1) B(c2,m0) B(c0,m1) B(c0,m0)
rank 1: F(c1,m0) F(c1,m1) F(c3,m0) F(c3,m1) B(c3,m1) B(c3,m0) B(c1,m1) B(c1,m0)
"""

from .actions import (
    BACKWARD_OPS,
    COMM_OPS,
    COMPUTE_OPS,
    RECV_OPS,
    REDUCE_OPS,
    SEND_OPS,
    WEIGHT_OPS,
    Action,
    Op,
    Schedule,
    chunks_of_rank,
    format_schedule,
    local_chunk,
    message_key,
    runs_backward,
    stage_rank,
)
from .generators import (
    DP_SYNC_MODES,
    SCHEDULE_NAMES,
    SPLIT_BACKWARD,
    build_schedule,
    insert_comms,
    insert_reductions,
    placement_of,
)
from .rules import (
    GatherRelease,
    RankRules,
    Rule,
    StepPolicy,
    rank_rules,
    schedule_rules,
    splits_tied_state,
    step_policy,
    tie_segments,
)
from .validate import ScheduleError, activations_peak, channels_of, validate_schedule

__all__ = [
    "Action",
    "BACKWARD_OPS",
    "COMM_OPS",
    "COMPUTE_OPS",
    "DP_SYNC_MODES",
    "GatherRelease",
    "Op",
    "RECV_OPS",
    "REDUCE_OPS",
    "RankRules",
    "Rule",
    "SCHEDULE_NAMES",
    "SEND_OPS",
    "SPLIT_BACKWARD",
    "WEIGHT_OPS",
    "Schedule",
    "StepPolicy",
    "ScheduleError",
    "activations_peak",
    "build_schedule",
    "channels_of",
    "chunks_of_rank",
    "format_schedule",
    "insert_comms",
    "insert_reductions",
    "local_chunk",
    "message_key",
    "runs_backward",
    "placement_of",
    "rank_rules",
    "schedule_rules",
    "splits_tied_state",
    "stage_rank",
    "step_policy",
    "tie_segments",
    "validate_schedule",
]
