"""Baselines ("anchors") the benchmarks compare foldtrain with; each is a torchrun script (run with ``-m``)."""
