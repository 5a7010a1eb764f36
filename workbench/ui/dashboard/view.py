"""``Dashboard``: a run's figures for the notebook (live widgets) and for a report file.

The main figure is always there; the expert-load heatmap (an expert-parallel MoE model
stepped), the stage timeline (a pipeline ran), the offload panel (a model offloaded) and the
inference panel (an engine generated) join it as figures of their own once the run has
their data, because a shown widget cannot be relayouted into a new subplot
grid (``figures.py``). The curves panel (loss, eval loss, LR, grad norm; ``curves.py``) joins on
top, with a smoothing slider like TensorBoard's, once some rank has run a training step. A
serving endpoint's dashboard (``workbench.serving.display``) has the
endpoint panel on top: requests/s, in flight and KV use of an ``EndpointHistory``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.ui.dashboard.curves import DEFAULT_SMOOTHING
from workbench.ui.dashboard.endpoint import EndpointHistory
from workbench.ui.dashboard.history import RunHistory


class Dashboard:
    """Shows a ``RunHistory``: displays as a box of plotly ``FigureWidget``s (the main figure,
    below it the expert-load heatmap once an expert-parallel step has been published, the
    stage timeline once a pipeline step has been published, the offload panel
    once a model has offloaded and the inference panel once an engine has stepped);
    ``to_html`` writes a standalone report. plotly is imported on first use, not with the
    magics."""

    def __init__(self, history: RunHistory, endpoint: EndpointHistory | None = None,
                 smoothing: float = DEFAULT_SMOOTHING) -> None:
        self.history = history
        self.endpoint = endpoint
        self.smoothing = smoothing
        self._curves: Any = None
        self._slider: Any = None
        self._curves_box: Any = None
        self._endpoint: Any = None
        self._widget: Any = None
        self._stages: Any = None
        self._offload: Any = None
        self._inference: Any = None
        self._expert_load: Any = None
        self._box: Any = None

    @property
    def figure(self) -> Any:
        """The live ``FigureWidget`` of the four main panels (built on first access)."""
        if self._widget is None:
            from workbench.ui.dashboard.figures import build_figure

            self._widget = build_figure(self.history, widget=True)
        return self._widget

    @property
    def curve_figure(self) -> Any:
        """The live ``FigureWidget`` of the curves panel, or None while no step was trained."""
        if self._curves is None:
            from workbench.ui.dashboard.figures import build_curve_figure

            self._curves = build_curve_figure(self.history, widget=True,
                                              smoothing=self.smoothing)
        return self._curves

    @property
    def slider(self) -> Any:
        """The smoothing slider above the curves (TensorBoard's: 0 is raw, default 0.6)."""
        if self._slider is None:
            import ipywidgets

            self._slider = ipywidgets.FloatSlider(
                value=self.smoothing, min=0.0, max=0.99, step=0.01, description="smoothing",
                continuous_update=False, readout_format=".2f")
            self._slider.observe(lambda change: self.set_smoothing(change["new"]), "value")
        return self._slider

    @property
    def curves_box(self) -> Any:
        """The slider over the curves figure, as one child of the shown box (so the curves
        join a shown dashboard as one new child), or None while no step was trained."""
        if self._curves_box is None and self.curve_figure is not None:
            import ipywidgets

            self._curves_box = ipywidgets.VBox((self.slider, self.curve_figure),
                                               layout=ipywidgets.Layout(width="100%"))
        return self._curves_box

    def set_smoothing(self, weight: float) -> None:
        """Smooth the curves with ``weight`` (0 = raw) and redraw them."""
        from workbench.ui.dashboard import figures

        self.smoothing = float(weight)
        if self._curves is not None:
            figures.update_curve_figure(self._curves, self.history, self.smoothing)

    @property
    def stage_figure(self) -> Any:
        """The live ``FigureWidget`` of the stage timeline, or None while no pipeline ran."""
        if self._stages is None:
            from workbench.ui.dashboard.figures import build_stage_figure

            self._stages = build_stage_figure(self.history, widget=True)
        return self._stages

    @property
    def offload_figure(self) -> Any:
        """The live ``FigureWidget`` of model state per tier, or None while nothing offloaded."""
        if self._offload is None:
            from workbench.ui.dashboard.figures import build_offload_figure

            self._offload = build_offload_figure(self.history, widget=True)
        return self._offload

    @property
    def inference_figure(self) -> Any:
        """The live ``FigureWidget`` of the inference panel, or None while no engine stepped."""
        if self._inference is None:
            from workbench.ui.dashboard.figures import build_inference_figure

            self._inference = build_inference_figure(self.history, widget=True)
        return self._inference

    @property
    def expert_load_figure(self) -> Any:
        """The live ``FigureWidget`` of the expert-load heatmap, or None while no rank has
        published expert load."""
        if self._expert_load is None:
            from workbench.ui.dashboard.figures import build_expert_load_figure

            self._expert_load = build_expert_load_figure(self.history, widget=True)
        return self._expert_load

    @property
    def endpoint_figure(self) -> Any:
        """The live ``FigureWidget`` of the endpoint panel, or None: no endpoint (or not
        sampled yet)."""
        if self._endpoint is None and self.endpoint is not None:
            from workbench.ui.dashboard.figures import build_endpoint_figure

            self._endpoint = build_endpoint_figure(self.endpoint, widget=True)
        return self._endpoint

    @property
    def widget(self) -> Any:
        """What is displayed: a ``VBox`` of the figures, so the stage timeline and the offload
        and inference panels can join a shown dashboard (new children) without redrawing or
        replacing the main figure."""
        if self._box is None:
            import ipywidgets

            self._box = ipywidgets.VBox(self._figures(),
                                        layout=ipywidgets.Layout(width="100%"))
        return self._box

    def refresh(self, endpoint_only: bool = False) -> None:
        """Push the history's current data into the widgets (one batched update each); the
        first pipeline step adds the stage timeline to a shown box, the first offloading steps
        the offload panel, an engine's first steps the inference panel. ``endpoint_only``:
        the ranks published nothing new, only the endpoint's figure moves."""
        from workbench.ui.dashboard import figures

        if self._endpoint is not None:
            figures.update_endpoint_figure(self._endpoint, self.endpoint)
        if endpoint_only:
            return
        if self._widget is not None:
            figures.update_figure(self._widget, self.history)
        if self._curves is not None:
            figures.update_curve_figure(self._curves, self.history, self.smoothing)
        if self._stages is not None:
            figures.update_stage_figure(self._stages, self.history)
        if self._offload is not None:
            figures.update_offload_figure(self._offload, self.history)
        if self._inference is not None:
            figures.update_inference_figure(self._inference, self.history)
        if self._expert_load is not None:
            figures.update_expert_load_figure(self._expert_load, self.history)
        if self._box is not None and self._new_figures():
            self._box.children = self._figures()

    def _new_figures(self) -> bool:
        """Builds the figures the run has data for by now; True if one of them is new (the
        new one is built from the current data, so it needs no update)."""
        missing = (self._stages is None, self._offload is None, self._inference is None,
                   self._endpoint is None, self._curves is None, self._expert_load is None)
        built = (self.stage_figure is not None, self.offload_figure is not None,
                 self.inference_figure is not None, self.endpoint_figure is not None,
                 self.curve_figure is not None, self.expert_load_figure is not None)
        return any(m and b for m, b in zip(missing, built))

    def to_figure(self) -> Any:
        """A static ``go.Figure`` of the four main panels, e.g. to save or restyle."""
        from workbench.ui.dashboard.figures import build_figure

        return build_figure(self.history, widget=False)

    def to_html(self, path: str | os.PathLike[str], include_plotlyjs: bool | str = True) -> Path:
        """Write a standalone HTML report: the endpoint panel if serving, the main figure,
        under it the training curves if the cell trained, the expert-load heatmap if an
        expert-parallel model stepped, the stage timeline if a pipeline ran, the offload panel
        if a model offloaded and the inference panel if an engine generated; plotly.js is
        embedded by default so the file opens offline (about 4.5 MB); pass
        ``include_plotlyjs="cdn"`` for a small file that loads it from the network."""
        from workbench.ui.dashboard import figures

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        endpoint = figures.build_endpoint_figure(self.endpoint, widget=False) \
            if self.endpoint is not None else None
        curves = figures.build_curve_figure(self.history, widget=False,
                                            smoothing=self.smoothing)
        shown = [f for f in (endpoint, self.to_figure(), curves,
                             figures.build_expert_load_figure(self.history, widget=False),
                             figures.build_stage_figure(self.history, widget=False),
                             figures.build_offload_figure(self.history, widget=False),
                             figures.build_inference_figure(self.history, widget=False))
                 if f is not None]
        # the first figure's page carries plotly.js, so every later figure finds it loaded
        page = shown[0].to_html(include_plotlyjs=include_plotlyjs, full_html=True)
        for extra in shown[1:]:
            div = extra.to_html(include_plotlyjs=False, full_html=False)
            page = page.replace("</body>", div + "</body>", 1)
        path.write_text(page, encoding="utf-8")
        return path

    def _figures(self) -> tuple[Any, ...]:
        top = (self.endpoint_figure, self.curves_box)
        extra = (self.expert_load_figure, self.stage_figure, self.offload_figure,
                 self.inference_figure)
        return (*(f for f in top if f is not None), self.figure,
                *(f for f in extra if f is not None))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The box's widget bundle plus a one-line ``text/plain`` for headless runs (a
        widget's own repr would be its whole state)."""
        bundle = dict(self.widget._repr_mimebundle_())
        bundle["text/plain"] = self.summary()
        return bundle

    def summary(self) -> str:
        """The run's one line, under the endpoint's when serving."""
        if self.endpoint is None:
            return self.history.summary()
        return f"colossal {self.endpoint.line()}\n{self.history.summary()}"

    def __repr__(self) -> str:
        return f"<Dashboard: {self.summary()}>"
