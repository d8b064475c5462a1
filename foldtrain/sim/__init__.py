"""Predict a training run on a cluster: discrete-event simulation of the executor's own schedules.

Pure Python (no torch): imports only :mod:`foldtrain.errors`, :mod:`foldtrain.model.presets`,
:mod:`foldtrain.schedules`, :mod:`foldtrain.config` and :mod:`foldtrain.profile`'s analysis.

* :mod:`.cluster`  cluster files and presets (``clusters/*.toml``)
* :mod:`.setup`    the run's layout, shape and precision, from a ``Config``
* :mod:`.costs`    FLOPs, bytes, links
* :mod:`.memory`   per-rank memory
* :mod:`.events`   the discrete-event engine over every action of every rank
* :mod:`.simulate` one configuration end to end; :mod:`.report` its table / JSON / profile
* :mod:`.plan`     search the layouts of a model on a cluster
* :mod:`.toy`      unit-cost runs of a schedule (``simulate_order``)
"""

from .toy import UnitCosts, events_from_simulation, simulate_order

__all__ = ["UnitCosts", "events_from_simulation", "simulate_order"]
