"""One typed configuration tree, loaded from TOML and the command line, validated in one place.

Every field can be set in a TOML file (``--config FILE``; sections are tables,
top-level fields are top-level keys) and overridden on the command line as
``--section.field value`` (torchtitan's convention); top-level fields are
``--field value``. Booleans may be given as a bare flag (``--resume``).
"""

from foldtrain.config.load import (
    all_keys,
    build_config,
    load_toml,
    parse_overrides,
    resolve,
    set_value,
    to_dict,
    to_toml,
)
from foldtrain.config.schema import (
    AC_MODES,
    COMPRESSIONS,
    DEVICES,
    DP_SYNCS,
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    CheckpointConfig,
    Config,
    DataConfig,
    DPConfig,
    FoldConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from foldtrain.config.validate import dataparallel_rows, dp_workers, validate, validate_world

__all__ = [
    "AC_MODES",
    "COMPRESSIONS",
    "DEVICES",
    "DP_SYNCS",
    "PRECISIONS",
    "SCHEDULES",
    "STRATEGIES",
    "CheckpointConfig",
    "Config",
    "DPConfig",
    "DataConfig",
    "FoldConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "all_keys",
    "build_config",
    "dataparallel_rows",
    "dp_workers",
    "load_toml",
    "parse_overrides",
    "resolve",
    "set_value",
    "to_dict",
    "to_toml",
    "validate",
    "validate_world",
]
