"""The plan tuner widget: every plan field as a control, live predictions, measured trials.

``workbench.tune(model)`` returns a ``Tuner`` (shown when it is a cell's value). The widget
layer is thin: ``controls`` (one widget per plan field, grouped by dimension), ``render`` (HTML
panes), ``breakdown`` (the prediction per rank, the step split, the Pareto front), ``figures``
(plotly figures of those, pure functions), ``panes`` (the shown figure widgets), ``trials``
(measurement on the pool through ``execution.run_cell``), ``tuner`` (the wiring).
"""

from workbench.tuner.trials import Trial
from workbench.tuner.tuner import Tuner, tune

__all__ = ["Trial", "Tuner", "tune"]
