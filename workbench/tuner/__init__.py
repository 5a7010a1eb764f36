"""The plan tuner widget: every plan field as a control, live predictions, measured trials.

``workbench.tune(model)`` returns a ``Tuner`` (shown when it is a cell's value). The widget
layer is thin: ``controls`` (one widget per plan field), ``render`` (HTML panes), ``trials``
(measurement on the pool through ``execution.run_cell``), ``tuner`` (the wiring).
"""

from workbench.tuner.trials import Trial
from workbench.tuner.tuner import Tuner, tune

__all__ = ["Trial", "Tuner", "tune"]
