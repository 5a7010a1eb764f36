""""Compare with the previous run": what the dashboard offers once a cell that trained ends.

Trying plan A in one cell and plan B in the next is the reason to use a notebook, and the
first question after the second cell is "better or worse than the last one?". So the figure of
``workbench.compare(previous, this)`` is one click away in both places a run is watched:

- the notebook: a button under the cell's live figure (``CompareButton``, shown by
  ``live.py``); a click draws the comparison under it, in the cell's output;
- the lab's dashboard page: the same figure as plain JSON in the pool-state file
  (``compare_panel``, written by ``workbench/ui/lab/state.py`` when the cell ends), drawn by
  the page's "compare with the previous run" button without a round trip to the kernel.

Both draw ``compare.compare`` itself, so the page, the button and a typed
``workbench.compare(-2, -1)`` show the very same traces.
"""

from __future__ import annotations

import json
from typing import Any

from workbench.ui.dashboard.compare import compare
from workbench.ui.dashboard.curves import DEFAULT_SMOOTHING
from workbench.ui.dashboard.runs import SESSION_RUNS, KeptRun

BUTTON_TEXT = "compare with the previous run"


def previous_run(run: KeptRun) -> KeptRun | None:
    """The session's kept run just before ``run``; None when ``run`` is the first one (or was
    never kept in ``SESSION_RUNS``)."""
    for i, kept in enumerate(SESSION_RUNS):
        if kept is run:
            return SESSION_RUNS[i - 1] if i > 0 else None
    return None


def compare_panel(previous: Any, this: Any,
                  smoothing: float = DEFAULT_SMOOTHING) -> dict[str, Any]:
    """``compare(previous, this)`` as the lab page draws a panel: ``{"title", "layout",
    "traces"}``, plain JSON (plotly's own encoding), its template and size left out (the page
    themes and sizes every plot itself; the template would be most of the file)."""
    doc = json.loads(compare(previous, this, smoothing=smoothing).to_json())
    layout = doc.get("layout", {})
    for key in ("template", "height", "width"):  # the page sizes and themes its plots
        layout.pop(key, None)
    title = layout.get("title", {})
    text = title.get("text", "") if isinstance(title, dict) else str(title)
    layout["title"] = {"text": f"{text}: the previous run and this one"}
    return {"title": layout["title"]["text"], "layout": layout, "traces": doc.get("data", [])}


class CompareButton:
    """A button that draws ``compare(previous, this)`` under itself when clicked (once: the
    figure stays, the button is disabled). Displays as its widget."""

    def __init__(self, previous: Any, this: Any) -> None:
        import ipywidgets as widgets

        self.previous, self.this = previous, this
        self.figure: Any = None  # the comparison, once drawn
        self.button = widgets.Button(description=BUTTON_TEXT, icon="columns",
                                     tooltip="draws workbench.compare(previous run, this run)",
                                     layout=widgets.Layout(width="auto"))
        self.output = widgets.Output()
        self.widget = widgets.VBox([self.button, self.output])
        self.button.on_click(self._clicked)

    def _clicked(self, _button: Any = None) -> None:
        from IPython.display import display

        if self.figure is not None:
            return
        self.figure = compare(self.previous, self.this)
        self.button.disabled = True
        with self.output:
            display(self.figure)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)
