"""Training primitives shared by every engine: AdamW groups, the LR schedule, mixed precision and
the weights-plus-optimizer state of a whole-model replica. Torch only; no parallelism."""

from foldtrain.optim.adamw import adamw_state, build_optimizer, load_adamw_state
from foldtrain.optim.lr import WarmupCosine, restore_lr
from foldtrain.optim.precision import LossScaler, Precision
from foldtrain.optim.state import TrainState

__all__ = [
    "LossScaler",
    "Precision",
    "TrainState",
    "WarmupCosine",
    "adamw_state",
    "build_optimizer",
    "load_adamw_state",
    "restore_lr",
]
