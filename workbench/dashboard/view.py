"""``Dashboard``: a run's figure for the notebook (a live widget) and for a report file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.dashboard.history import RunHistory


class Dashboard:
    """Shows a ``RunHistory``: displays as a plotly ``FigureWidget``; ``to_html`` writes a
    standalone report. plotly is imported on first use, not with the magics."""

    def __init__(self, history: RunHistory) -> None:
        self.history = history
        self._widget: Any = None

    @property
    def figure(self) -> Any:
        """The live ``FigureWidget`` (built on first access)."""
        if self._widget is None:
            from workbench.dashboard.figures import build_figure

            self._widget = build_figure(self.history, widget=True)
        return self._widget

    def refresh(self) -> None:
        """Push the history's current data into the widget (one batched update)."""
        if self._widget is not None:
            from workbench.dashboard.figures import update_figure

            update_figure(self._widget, self.history)

    def to_figure(self) -> Any:
        """A static ``go.Figure`` of the history, e.g. to save or restyle."""
        from workbench.dashboard.figures import build_figure

        return build_figure(self.history, widget=False)

    def to_html(self, path: str | os.PathLike[str], include_plotlyjs: bool | str = True) -> Path:
        """Write a standalone HTML report; plotly.js is embedded by default so the file opens
        offline (about 4.5 MB); pass ``include_plotlyjs="cdn"`` for a small file that loads
        it from the network."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.to_figure().write_html(path, include_plotlyjs=include_plotlyjs, full_html=True)
        return path

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget's bundle plus a one-line ``text/plain`` for headless runs (plotly's own
        widget bundle has none, and a figure's repr would be its whole JSON)."""
        bundle = dict(self.figure._repr_mimebundle_())
        bundle["text/plain"] = self.history.summary()
        return bundle

    def __repr__(self) -> str:
        return f"<Dashboard: {self.history.summary()}>"
