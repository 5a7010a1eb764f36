"""The dashboard of a running cell: the ``data_sink`` that ``run_cell`` feeds.

``run_cell`` polls in the notebook's main thread and calls the sink at most about four times a
second, so displaying and updating happen in the running cell, and widget updates reach the
browser while the cell is still busy (kernel-to-browser messages are not held back by a busy
kernel; see NOTES.md). Modes: ``"auto"`` shows the figure once the cell has run for
``show_after_s`` and some rank has published telemetry (quick cells stay uncluttered), ``"on"``
shows it from the start, ``"off"`` never shows it. The history is kept in every mode, for
``workbench.show_dashboard()`` after the run. Redraws are rate-limited by their own cost
(``DRAW_SHARE``), since they compete with the ranks for the cores. When a cell that trained
ends, its run is kept (``runs.py``: in the session's runs and as a run directory with
TensorBoard events) and, if an earlier cell's run was kept too, a button under the figure
offers "compare with the previous run" (``previous.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.previous import CompareButton, previous_run
from workbench.ui.dashboard.runs import KeptRun, keep_run
from workbench.ui.dashboard.view import Dashboard

MODES = ("auto", "on", "off")
# Redrawing runs in the kernel, on the cores the ranks train on, and ranks that step together
# all wait for the one whose core it takes: the figure is redrawn at most every MIN_REDRAW_S,
# and after a redraw that took t seconds not before t / DRAW_SHARE (drawing takes at most ~2%
# of the time), but at least every MAX_REDRAW_S while data changes. Data is ingested at every
# poll whatever the redraw rate, so no point of a curve is lost.
MIN_REDRAW_S, MAX_REDRAW_S, DRAW_SHARE = 0.25, 1.0, 0.02


class LiveDashboard:
    """Collects a run's telemetry and keeps a displayed figure current."""

    def __init__(self, ranks: list[int], *, mode: str = "auto", show_after_s: float = 2.0,
                 label: str = "", plan: str = "", runs_dir: str | None = None,
                 display: Callable[[Any], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in MODES:
            raise ValueError(f"dashboard mode must be one of {MODES}, got {mode!r}")
        self.mode, self.show_after_s = mode, show_after_s
        self.history = RunHistory(ranks, label=label, plan=plan, clock=clock)
        self.runs_dir = runs_dir  # None: $WORKBENCH_RUNS_DIR, else ./runs (``runs.py``)
        self.kept: KeptRun | None = None  # the run kept when the cell ended, if it trained
        self.compare_button: CompareButton | None = None  # offered under the figure then
        self.view: Dashboard | None = None
        self.refreshes = 0  # figure updates sent after it was shown
        self._clock = clock
        self._due = float("-inf")  # clock time from which the next redraw may run
        self._stale = False  # data ingested since the last redraw that it does not show
        self._display = display

    def start(self) -> None:
        """Called as the cell starts: ``"on"`` shows the (empty) figure at once."""
        if self.mode == "on":
            self._show()

    def __call__(self, data: dict[int, dict[str, Any]], final: bool) -> None:
        changed = self.history.ingest(data)
        if final and self.history.seconds is None:
            self.history.finish()
            self.kept = keep_run(self.history, self.runs_dir)
            self._offer_compare()
        if self.mode == "off":
            return
        if self.view is None:
            # Only a running cell gets a new figure: a cell that has just ended (or was
            # interrupted) must return at once; workbench.show_dashboard() shows it afterwards.
            if not final and self.history.has_data and self.history.elapsed >= self.show_after_s:
                self._show()
        elif changed or self._stale:
            now = self._clock()
            if not (final or now >= self._due):
                self._stale = True  # drawn at the next due poll, or when the cell ends
                return
            self.view.refresh()
            took = self._clock() - now
            self._stale = False
            self._due = now + min(MAX_REDRAW_S, max(MIN_REDRAW_S, took / DRAW_SHARE))
            self.refreshes += 1

    def _offer_compare(self) -> None:
        """Under a shown figure of a cell that trained, after another that did: the button
        drawing ``compare(previous, this)`` (``previous.py``)."""
        previous = previous_run(self.kept) if self.kept is not None else None
        if self.view is None or previous is None:
            return
        self.compare_button = CompareButton(previous, self.kept)
        show = self._display
        if show is None:
            from IPython.display import display as show
        show(self.compare_button)

    def _show(self) -> None:
        self.view = Dashboard(self.history)
        show = self._display
        if show is None:
            from IPython.display import display as show
        show(self.view)
