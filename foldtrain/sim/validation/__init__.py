"""Published measurements the simulator is held against (``gpu_runs.toml``) and the sources of the GPU presets'
constants (``microbenchmarks.toml``); ``python -m foldtrain.sim.validation.gpu`` writes docs/validation-gpu.md."""
