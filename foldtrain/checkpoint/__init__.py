from foldtrain.checkpoint.export import export_safetensors, import_safetensors
from foldtrain.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager", "export_safetensors", "import_safetensors"]
