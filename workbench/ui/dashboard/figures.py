"""The dashboard's plotly figures, built from a ``RunHistory`` and updated in place.

One figure, four panels, so a live update is one ``batch_update`` (one message to the browser):

- memory per tier per rank, stacked (device allocated, host RSS, disk spill), latest values;
- step time per rank, stacked (compute, communication, waiting), cumulative seconds;
- communication bytes per mesh axis, summed over ranks, cumulative, over time: collectives
  (``"comm: dp"``) and, dotted, point-to-point bytes sent (``"p2p: pp"``, a pipeline's traffic);
- throughput per rank (tokens/s over its recent steps), over time; samples/s and achieved
  FLOP/s in the hover text.

And once some rank has run a pipeline step, a second figure: the stage timeline
(``timeline.py``), which micro-batch each pipeline rank ran when, and its bubble. It is a
figure of its own because a shown widget does not reliably take a new subplot grid in place
(relayouting a shown ``FigureWidget`` into five panels garbles it in JupyterLab, and replacing
the output of a running cell detaches the old view with an error), while adding a figure
next to the shown one is an ordinary widget operation.

Once some rank has run a training step, the curves panel (``curves.py``: loss and eval loss on
a log axis, learning rate, grad norm, smoothed like TensorBoard's) joins as a figure of its own,
above the main figure in the notebook.

Likewise, once some rank's model has offloaded during the cell, a figure of its own: model
state per tier per rank and what moved between tiers per step (``offload.py``); and once some
rank's inference engine has stepped, another: generated tokens/s, the queue and the KV blocks
per replica (``inference.py``); and once some rank has published expert load (an
expert-parallel MoE model stepped), another: tokens per expert per MoE layer of the last step,
summed over ranks, as a heatmap (``expert_load.py``). While an endpoint serves, its panel
(``endpoint.py``: requests/s, in flight, KV use) stands above them all.

Values are the runtime's own numbers, unscaled (bytes, seconds), so what a figure shows can be
checked against ``CommStats`` and ``Telemetry.snapshot()``; axes print them with a unit (``1.2MB``,
``3 s``) and hovers in MiB. Colours, units and the light/dark theme come from ``style.py``, for
every builder here and elsewhere (``compare``, the tuner, the lab's dashboard page).
Every trace has a unique name (``"memory: host"``, ``"comm: dp"``, ``"tokens/s: rank 0"``,
``"stage: F (forward)"``, ``"model state: disk"``, ``"moved: host->disk"``,
``"queue: waiting"``, ``"KV blocks: free"``, ``"endpoint: requests/s"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.ui.dashboard.curves import DEFAULT_SMOOTHING, curve_layout, curve_traces
from workbench.ui.dashboard.endpoint import EndpointHistory, endpoint_layout, endpoint_traces
from workbench.ui.dashboard.expert_load import (
    expert_load_height,
    expert_load_layout,
    expert_load_traces,
)
from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.inference import inference_layout, inference_traces
from workbench.ui.dashboard.offload import offload_layout, offload_traces
from workbench.ui.dashboard.style import (
    BYTES_AXIS,
    SECONDS_AXIS,
    colour,
    sizes,
    themed,
)
from workbench.ui.dashboard.timeline import stage_axes, stage_title, stage_traces

TIERS = (("device", "device_allocated"), ("host", "host_rss"), ("disk", "disk_spill"))
PARTS = ("compute", "comm", "waiting")
TITLES = ("memory per tier (now)", "step time (s, cumulative)",
          "communication per axis (all ranks; p2p: sent)",
          "throughput (tokens/s, recent steps)")

TraceSpec = tuple[str, int, int, dict[str, Any]]  # (kind, row, col, properties)


def trace_specs(history: RunHistory) -> dict[str, TraceSpec]:
    """Every trace's name, panel and data, computed from ``history`` alone."""
    labels = [f"rank {r}" for r in history.ranks]
    latest = [history.latest.get(r, {}) for r in history.ranks]
    specs: dict[str, TraceSpec] = {}
    for tier, key in TIERS:
        y = [s.get("memory", {}).get(key, 0) for s in latest]
        specs[f"memory: {tier}"] = ("bar", 1, 1, {
            "x": labels, "y": y, "customdata": sizes(y), "marker": {"color": colour(tier)},
            "hovertemplate": f"%{{x}}: %{{y:,}} B (%{{customdata}}) on {tier}<extra></extra>"})
    for part in PARTS:
        y = [s.get("seconds", {}).get(part, 0.0) for s in latest]
        specs[f"time: {part}"] = ("bar", 1, 2, {
            "x": labels, "y": y, "marker": {"color": colour(part)},
            "hovertemplate": f"%{{x}}: %{{y:.3f}} s {part}<extra></extra>"})
    t = history.times()
    for axis in history.axes():
        y = history.comm_bytes(axis)
        specs[f"comm: {axis}"] = ("line", 2, 1, {
            "x": t, "y": y, "customdata": sizes(y), "line": {"color": colour(f"comm: {axis}")},
            "hovertemplate": f"{axis}: %{{y:,}} B (%{{customdata}}) at %{{x:.1f}} s"
                             "<extra></extra>"})
    for axis in history.axes("p2p_by_axis"):
        y = history.p2p_bytes(axis)
        specs[f"p2p: {axis}"] = ("line", 2, 1, {
            "x": t, "y": y, "customdata": sizes(y),
            "line": {"dash": "dot", "color": colour(f"comm: {axis}")},
            "hovertemplate": f"{axis} p2p sent: %{{y:,}} B (%{{customdata}}) at %{{x:.1f}} s"
                             "<extra></extra>"})
    for r in history.ranks:
        samples = history.rank_series(r, "samples_per_s")
        flops = history.rank_series(r, "flops_per_s")
        hover = [f"{s:,.1f} samples/s, {f / 1e9:,.2f} GFLOP/s" for s, f in zip(samples, flops)]
        specs[f"tokens/s: rank {r}"] = ("line", 2, 2, {
            "x": t, "y": history.rank_series(r, "tokens_per_s"), "customdata": hover,
            "line": {"color": colour(r)}, "marker": {"color": colour(r)},
            "hovertemplate": f"rank {r}: %{{y:,.1f}} tokens/s at %{{x:.1f}} s<br>"
                             "%{customdata}<extra></extra>"})
    return specs


def _trace(name: str, kind: str, props: dict[str, Any]) -> go.BaseTraceType:
    group = name.split(":")[0]
    if kind == "bar":
        return go.Bar(name=name, legendgroup=group, **props)
    return go.Scatter(name=name, legendgroup=group, mode="lines+markers", **props)


def build_figure(history: RunHistory, widget: bool = True) -> go.Figure:
    """A new figure (a ``FigureWidget`` for live updates) showing ``history``."""
    fig = make_subplots(rows=2, cols=2, subplot_titles=TITLES, horizontal_spacing=0.1,
                        vertical_spacing=0.18)
    for name, (kind, row, col, props) in trace_specs(history).items():
        fig.add_trace(_trace(name, kind, props), row=row, col=col)
    fig.update_layout(barmode="stack", height=620, margin={"t": 70, "b": 40},
                      title=history.label or "colossal run", legend={"font": {"size": 10}})
    themed(fig)
    fig.update_yaxes(BYTES_AXIS, row=1, col=1)
    fig.update_yaxes(BYTES_AXIS, row=2, col=1)
    fig.update_yaxes(SECONDS_AXIS, row=1, col=2)
    fig.update_yaxes(tickformat="~s", ticksuffix=" tok/s", row=2, col=2)
    fig.update_xaxes(title_text="s since the cell started", row=2)
    return go.FigureWidget(fig) if widget else fig


def update_figure(fig: go.Figure, history: RunHistory) -> None:
    """Bring ``fig`` up to date: new traces (an axis used for the first time) are added, then
    every trace's data is replaced in one batch."""
    specs = trace_specs(history)
    have = {trace.name for trace in fig.data}
    for name, (kind, row, col, props) in specs.items():
        if name not in have:
            fig.add_trace(_trace(name, kind, props), row=row, col=col)
    with fig.batch_update():
        for trace in fig.data:
            if trace.name in specs:
                _update_trace(fig, trace, specs[trace.name][3])


# ---- the stage timeline ------------------------------------------------------------------
def _stage_layout(history: RunHistory) -> dict[str, Any]:
    timelines = history.pipelines()
    x, y = stage_axes(timelines)
    return {"title": {"text": stage_title(timelines), "font": {"size": 14}}, "xaxis": x,
            "yaxis": y, "height": 160 + 70 * len(timelines), "barmode": "overlay"}


def build_stage_figure(history: RunHistory, widget: bool = True) -> go.Figure | None:
    """The stage timeline of ``history`` as its own figure; None if no pipeline ran."""
    if not history.pipelines():
        return None
    fig = themed(go.Figure(layout={**_stage_layout(history),
                                   "margin": {"t": 50, "b": 40, "l": 120},
                                   "legend": {"font": {"size": 10}, "orientation": "h",
                                              "y": -0.25}}))
    for name, props in stage_traces(history.pipelines()).items():
        fig.add_trace(go.Bar(name=name, legendgroup="stage", **props))
    return go.FigureWidget(fig) if widget else fig


def update_stage_figure(fig: go.Figure, history: RunHistory) -> None:
    """Bring the stage figure up to date in one batch (a kind seen for the first time, such as
    zbv's W, adds its trace)."""
    traces = stage_traces(history.pipelines())
    have = {trace.name for trace in fig.data}
    for name, props in traces.items():
        if name not in have:
            fig.add_trace(go.Bar(name=name, legendgroup="stage", **props))
    with fig.batch_update():
        for trace in fig.data:
            trace.update(traces.get(trace.name, {"x": [], "y": [], "base": [], "text": []}))
        fig.update_layout(_stage_layout(history))


# ---- panels of plain-dict traces: model state per tier, the inference engine -------------
Traces = Callable[..., dict[str, dict[str, Any]]]
Layout = Callable[[Any], dict[str, Any]]  # of a RunHistory, or an EndpointHistory


def _build_panel(history: Any, traces: Traces, layout: Layout, height: int,
                 widget: bool, top: int = 50) -> go.Figure | None:
    """A figure of ``traces(history)`` (plain dicts, ``type`` included) under
    ``layout(history)``, ``top`` pixels above the plots for the title; None while the history
    has no data for it."""
    data = traces(history)
    if not data:
        return None
    fig = themed(go.Figure(layout={**layout(history), "height": height,
                                   "margin": {"t": top, "b": 40},
                                   "legend": {"font": {"size": 10}, "orientation": "h",
                                              "y": -0.2, "traceorder": "normal"}}))
    for name, props in data.items():
        fig.add_trace({**props, "name": name})
    return go.FigureWidget(fig) if widget else fig


def _update_panel(fig: go.Figure, history: Any, traces: Traces,
                  layout: Layout) -> None:
    """Bring a panel up to date in one batch; a trace seen for the first time is added."""
    data = traces(history)
    have = {trace.name for trace in fig.data}
    for name, props in data.items():
        if name not in have:
            fig.add_trace({**props, "name": name})
    with fig.batch_update():
        for trace in fig.data:
            props = dict(data.get(trace.name, {"x": [], "y": []}))
            props.pop("type", None)
            _update_trace(fig, trace, props)
        _update_layout(fig, layout(history))


# A redraw runs in the kernel while the ranks train, on the same cores; plotly validates every
# property it is given (about 20 ms for the curves panel's layout alone), so only what changed
# since the last update is handed over. What was last applied is kept on the figure.
def _applied(fig: go.Figure) -> dict[Any, dict[str, Any]]:
    if not hasattr(fig, "_wb_applied"):
        fig._wb_applied = {}
    return fig._wb_applied


def _update_trace(fig: go.Figure, trace: Any, props: dict[str, Any]) -> None:
    """``trace.update(props)`` with only the properties that differ from the last update."""
    last = _applied(fig).setdefault(("trace", trace.name), {})
    changed = {k: v for k, v in props.items() if k not in last or last[k] != v}
    if changed:
        trace.update(changed)
        last.update(changed)


def _update_layout(fig: go.Figure, layout: dict[str, Any]) -> None:
    """``fig.update_layout(layout)`` with only the top-level entries that changed."""
    last = _applied(fig).setdefault("layout", {})
    changed = {k: v for k, v in layout.items() if k not in last or last[k] != v}
    if changed:
        fig.update_layout(changed)
        last.update(changed)


def build_offload_figure(history: RunHistory, widget: bool = True) -> go.Figure | None:
    """The offload panel of ``history`` as its own figure; None while nothing offloaded."""
    return _build_panel(history, offload_traces, offload_layout, 380, widget)


def update_offload_figure(fig: go.Figure, history: RunHistory) -> None:
    """Bring the offload figure up to date in one batch (a pair moved for the first time, such
    as host->disk once the host tier is full, adds its trace)."""
    _update_panel(fig, history, offload_traces, offload_layout)


def build_inference_figure(history: RunHistory, widget: bool = True) -> go.Figure | None:
    """The inference panel of ``history`` as its own figure; None while no engine stepped."""
    return _build_panel(history, inference_traces, inference_layout, 400, widget, top=70)


def update_inference_figure(fig: go.Figure, history: RunHistory) -> None:
    """Bring the inference figure up to date in one batch (a second replica adds its line)."""
    _update_panel(fig, history, inference_traces, inference_layout)


def build_expert_load_figure(history: RunHistory, widget: bool = True) -> go.Figure | None:
    """The expert-load heatmap of ``history`` as its own figure; None while no rank has
    published expert load in this cell."""
    return _build_panel(history, expert_load_traces, expert_load_layout,
                        expert_load_height(history), widget, top=70)


def update_expert_load_figure(fig: go.Figure, history: RunHistory) -> None:
    """Bring the heatmap up to date in one batch (the last step's counts, the title's
    imbalance)."""
    _update_panel(fig, history, expert_load_traces, expert_load_layout)


def build_curve_figure(history: RunHistory, widget: bool = True,
                       smoothing: float = DEFAULT_SMOOTHING) -> go.Figure | None:
    """The curves panel (loss and eval loss, LR, grad norm per step, ``curves.py``) as its own
    figure; None while no rank has published a training step."""
    return _build_panel(history, lambda h: curve_traces(h.curves, smoothing),
                        lambda h: curve_layout(h.curves, smoothing), 360, widget)


def update_curve_figure(fig: go.Figure, history: RunHistory,
                        smoothing: float = DEFAULT_SMOOTHING) -> None:
    """Bring the curves figure up to date in one batch (new steps, or a new smoothing)."""
    _update_panel(fig, history, lambda h: curve_traces(h.curves, smoothing),
                  lambda h: curve_layout(h.curves, smoothing))


def build_endpoint_figure(endpoint: EndpointHistory, widget: bool = True) -> go.Figure | None:
    """The endpoint panel as its own figure; None before the endpoint's first sample."""
    return _build_panel(endpoint, endpoint_traces, endpoint_layout, 360, widget, top=70)


def update_endpoint_figure(fig: go.Figure, endpoint: EndpointHistory) -> None:
    """Bring the endpoint figure up to date in one batch (its title is the endpoint's line)."""
    _update_panel(fig, endpoint, endpoint_traces, endpoint_layout)


def trace_data(fig: go.Figure) -> dict[str, tuple[list, list]]:
    """``{trace name: (x, y)}`` as plain lists: what a figure shows, for checks and tests."""
    return {t.name: (list(t.x) if t.x is not None else [], list(t.y) if t.y is not None else [])
            for t in fig.data}
