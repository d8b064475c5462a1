from foldtrain.checkpoint.export import export_safetensors, import_safetensors
from foldtrain.checkpoint.manager import CheckpointManager
from foldtrain.checkpoint.rundir import RunPlan, plan_run

__all__ = ["CheckpointManager", "RunPlan", "export_safetensors", "import_safetensors", "plan_run"]
