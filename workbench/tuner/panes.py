"""The tuner's shown figures: plotly ``FigureWidget``s kept in place and refreshed.

A shown widget is updated rather than replaced (replacing a cell's output while it is shown
detaches the old view): each refresh builds a new figure with ``figures`` and copies it into
the widget in one batch, trace by trace when the traces are the same ones (the usual case as a
control moves), else by swapping the traces; the widget's synced state follows, so a view
drawn later (or one whose script loaded after the edits) draws the same figure. The
candidates and trials figures stay hidden until there is something to draw (``Recommend``, a
measured trial).

Figures are drawn only once the tuner is shown (``start``, called by ``Tuner``'s display):
building plotly figures costs a tenth of a second per control move and importing plotly a
second, which a tuner used from a script or a test never looks at. Until then the latest
prediction, candidates and trials are kept, and ``start`` draws them.

A click on a candidate point calls ``on_pick`` with that point's plan: the plan string each
candidate trace carries in ``customdata`` (``figures.candidates_figure``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from kernels_runtime.mesh.plan import Plan
from workbench.planner.cost_model import Prediction
from workbench.tuner.trials import Trial

if TYPE_CHECKING:
    import plotly.graph_objects as go

HIDDEN, SHOWN = "none", "block"


def refresh(widget: go.FigureWidget, fig: go.Figure) -> None:
    """Make the shown ``widget`` draw ``fig``, in one message to the browser."""
    same = [(t.type, t.name) for t in widget.data] == [(t.type, t.name) for t in fig.data]
    with widget.batch_update():
        if same:
            for old, new in zip(widget.data, fig.data):
                old.update(new.to_plotly_json(), overwrite=True)
        else:
            widget.data = []
            widget.add_traces(list(fig.data))
        widget.layout = fig.layout
    # The edits above reach a view only through the browser's figure model, which starts
    # listening once plotly's widget script has loaded, after the widget was created: edits
    # sent before are lost and the view drew an empty figure. The model's state is what a view
    # draws first, so it is kept equal to the figure (what plotly does for a figure displayed
    # on its own, in ``_repr_mimebundle_``; here the figure is a child of the tuner's box).
    widget._widget_data = deepcopy(widget._data)
    widget._widget_layout = deepcopy(widget._layout_obj._props)


class TunerFigures:
    """The prediction's memory and step-time figures, the candidates, the trials."""

    def __init__(self, on_pick: Callable[[Plan], Any]) -> None:
        self.on_pick = on_pick
        self.live = False  # drawing: the tuner has been shown (``start``)
        self.memory: Any = None  # FigureWidgets once started
        self.time: Any = None
        self.candidates: Any = None
        self.trials: Any = None
        self.prediction_box = widgets.VBox([])
        self.candidates_box = widgets.VBox([], layout=widgets.Layout(display=HIDDEN))
        self.trials_box = widgets.VBox([], layout=widgets.Layout(display=HIDDEN))
        self._prediction: Prediction | None = None
        self._budget: dict[str, float | None] = {}
        self._candidates: list[Prediction] = []
        self._candidate_budget = 0.0
        self._recommended: Plan | None = None
        self._selected: Plan | None = None
        self._drawn = False  # the candidates figure shows self._candidates
        self._trials: list[Trial] = []

    def start(self) -> None:
        """Draw from now on, beginning with what is kept (what showing the tuner does)."""
        if self.live:
            return
        import plotly.graph_objects as go

        self.memory, self.time, self.candidates, self.trials = (
            go.FigureWidget() for _ in range(4))
        self.prediction_box.children = [self.memory, self.time]
        self.candidates_box.children = [self.candidates]
        self.trials_box.children = [self.trials]
        self.live = True
        self._draw_prediction()
        self._draw_candidates()
        self._draw_trials()

    # ---- what the tuner reports ---------------------------------------------------------
    def show_prediction(self, p: Prediction | None, budget: dict[str, float | None]) -> None:
        """``p``'s memory per rank and step split; none for an invalid plan."""
        self._prediction, self._budget = p, budget
        self._draw_prediction()

    def show_candidates(self, candidates: Sequence[Prediction], budget: float,
                        recommended: Plan | None) -> None:
        """Every candidate of a recommendation, clickable."""
        self._candidates, self._candidate_budget = list(candidates), budget
        self._recommended, self._drawn = recommended, False
        self._draw_candidates()

    def mark_selected(self, selected: Plan | None) -> None:
        """Ring ``selected`` among the candidates (when it is one)."""
        self._selected = selected
        self._draw_candidates()

    def show_trials(self, trials: Sequence[Trial]) -> None:
        self._trials = list(trials)
        self._draw_trials()

    # ---- drawing ------------------------------------------------------------------------
    def _draw_prediction(self) -> None:
        if not self.live:
            return
        from workbench.tuner import figures

        p = self._prediction
        if p is None:
            self.prediction_box.layout.display = HIDDEN
            return
        refresh(self.memory, figures.memory_figure(p, self._budget))
        refresh(self.time, figures.time_figure(p))
        self.prediction_box.layout.display = SHOWN

    def _draw_candidates(self) -> None:
        if not self.live or not self._candidates:
            return
        from workbench.tuner import figures

        if self._drawn:  # only the ring moves
            mark = figures.marked_trace("selected", self._candidates, self._selected)
            ring = next(t for t in self.candidates.data if t.name == "selected")
            ring.update(mark.to_plotly_json(), overwrite=True)
            return
        refresh(self.candidates, figures.candidates_figure(
            self._candidates, self._candidate_budget, self._recommended, self._selected))
        for trace in self.candidates.data:
            trace.on_click(self._clicked)
        self._drawn = True
        self.candidates_box.layout.display = SHOWN

    def _draw_trials(self) -> None:
        if not self.live or not any(t.ok for t in self._trials):
            return
        from workbench.tuner import figures

        refresh(self.trials, figures.trials_figure(self._trials))
        self.trials_box.layout.display = SHOWN

    def _clicked(self, trace: Any, points: Any, _state: Any) -> None:
        """plotly calls every trace's handler on a click; only the clicked one has points."""
        if points.point_inds:
            self.on_pick(Plan.parse(trace.customdata[points.point_inds[0]]))
