"""Live plots of what the ranks publish: memory per tier, communication, throughput, a
pipeline's stage timeline, an offloading model's state per tier and traffic between tiers, and
an inference engine's generated tokens/s, queue and KV blocks.

``%%colossal`` feeds a ``LiveDashboard`` from its waiting loop; ``workbench.dashboard()``
shows the last run afterwards and ``.to_html(path)`` writes a standalone report. plotly is
imported only when a figure is first built.
"""

from __future__ import annotations

import threading
from typing import Any

from workbench.dashboard.history import RunHistory
from workbench.dashboard.live import LiveDashboard
from workbench.dashboard.view import Dashboard

__all__ = ["Dashboard", "LiveDashboard", "RunHistory", "dashboard", "preload"]


def preload() -> threading.Thread:
    """Import plotly's widget stack in a background thread.

    Its first import takes seconds (plotly.io pulls in nbformat and jsonschema); paid when a
    dashboard first appears it would stall the waiting loop, and with it the cell's output, for
    that long. ``%colossal start`` calls this while it waits for the engines. Module locks make
    a concurrent import from the main thread simply wait for this one."""

    def work() -> None:
        from plotly.graph_objs import FigureWidget  # noqa: F401

        from workbench.dashboard import figures  # noqa: F401

    thread = threading.Thread(target=work, name="workbench-dashboard-preload", daemon=True)
    thread.start()
    return thread


def dashboard(run: RunHistory | LiveDashboard | None = None, shell: Any = None) -> Dashboard:
    """The dashboard of ``run``, by default the last ``%%colossal`` cell of this session.

    Display it (last expression of a cell) for the interactive figure, or write a report with
    ``workbench.dashboard().to_html("reports/run.html")``."""
    if isinstance(run, LiveDashboard):
        run = run.history
    if run is None:
        from workbench.magics import active_magics

        magics = active_magics(shell)
        run = magics.last_run if magics is not None else None
        if run is None:
            raise ValueError("no %%colossal cell has run in this session yet")
    return Dashboard(run)
