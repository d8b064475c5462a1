from foldtrain.model.gpt import GPT, GPTShape, lm_loss
from foldtrain.model.presets import PRESETS, analytic_param_count

__all__ = ["GPT", "GPTShape", "lm_loss", "PRESETS", "analytic_param_count"]
