"""Live plots of what the ranks publish: memory per tier, communication, throughput, a
pipeline's stage timeline, an offloading model's state per tier and traffic between tiers, and
an inference engine's generated tokens/s, queue and KV blocks; and a training cell's curves
(loss and eval loss, LR, grad norm per step, ``curves.py``).

A cell that trains is kept as a run (``runs.py``: a run directory with TensorBoard events
under ``runs/``, and MLflow metrics when asked, ``mlflow_log.py``), ``workbench.compare``
(``compare.py``) overlays kept runs, and a run offers comparing itself with the session's
previous one (``previous.py``: a button under the notebook's figure, a panel on the lab page).
Every figure is drawn theme-neutral with one colour per rank and units on every axis
(``style.py``); the lab's extension restyles it for the lab's light or dark theme.

``%%colossal`` feeds a ``LiveDashboard`` from its waiting loop; ``workbench.show_dashboard()``
shows the last run afterwards and ``.to_html(path)`` writes a standalone report. plotly is
imported only when a figure is first built.

This package draws; it does not know which cell ran last. Finding the last run belongs to
the magics (``workbench.show_dashboard`` asks them), so nothing here imports the layer that
feeds it, and ``workbench.ui.dashboard`` stays this package, not a function shadowing it.
"""

from __future__ import annotations

import threading

from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.live import LiveDashboard
from workbench.ui.dashboard.view import Dashboard

__all__ = ["Dashboard", "LiveDashboard", "RunHistory", "preload"]


def preload() -> threading.Thread:
    """Import plotly's widget stack in a background thread.

    Its first import takes seconds (plotly.io pulls in nbformat and jsonschema); paid when a
    dashboard first appears it would stall the waiting loop, and with it the cell's output, for
    that long. ``%colossal start`` calls this while it waits for the engines. Module locks make
    a concurrent import from the main thread simply wait for this one."""

    def work() -> None:
        from plotly.graph_objs import FigureWidget  # noqa: F401

        from workbench.ui.dashboard import figures  # noqa: F401

    thread = threading.Thread(target=work, name="workbench-dashboard-preload", daemon=True)
    thread.start()
    return thread
