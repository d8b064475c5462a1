"""Parallelism applied from outside the model: the device mesh, tensor parallelism, data-parallel
strategies (``dp``) and pipeline stages, transport and executor (``pipeline``). Engines
(:mod:`foldtrain.engine`) compose these pieces; nothing here knows about engines or the loop."""
