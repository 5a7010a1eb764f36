"""The tuner's plotly figures, pure functions of the planner's outputs.

- ``memory_figure``: the plan's predicted memory per rank, one plot per tier (device, host,
  disk), stacked by category, against that tier's budget (a dashed line, in the title too);
- ``time_figure``: the predicted step time split into compute, exposed communication per mesh
  axis, optimizer, overhead, pipeline bubble and offload I/O (``breakdown.step_split``);
- ``candidates_figure``: every candidate of ``recommend`` as a point, step time against peak
  device memory, the Pareto front joined, the recommended and the selected plans marked; each
  point carries its plan (``customdata``: ``Plan.to_string()``) for a click to select;
- ``trials_figure``: measured trials, predicted against measured (step time, memory).

The dashboard's conventions (``dashboard.style``): bytes drawn in MiB (2**20), times in seconds,
one colour per tier (categories differ by pattern), theme-neutral figures that follow the lab's
light and dark themes, and every trace has a unique name.
Nothing here holds state: the tuner builds a figure and copies it into its shown widget.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kernels_runtime.mesh.plan import Plan
from workbench.planner.cost_model import Prediction, plan_label
from workbench.planner.setting import CATEGORIES, TIERS
from workbench.tuner.breakdown import (
    Memory,
    exposed_by_axis,
    pareto_front,
    rank_memory,
    stage_memory,
    step_split,
)
from workbench.tuner.render import seconds, size
from workbench.tuner.trials import Trial
from workbench.ui.dashboard.style import NEUTRAL_TEXT, colour, themed

MIB = 2**20
TIER_COLOUR = {tier: colour(tier) for tier in ("device", "host", "disk")}
PATTERN = {"params": "", "grads": "/", "optimizer": "x", "activations": ".", "buffers": "-"}
PART_COLOUR = {"compute": colour("compute"), "optimizer": "#54a24b", "overhead": "#9d755d",
               "pipeline bubble": "#bab0ac", "offload I/O": "#b279a2"}
AXIS_COLOUR = {  # per mesh axis, the same in every plan
    "comm: dp": colour("comm"), "comm: dp_sp": colour("comm"), "comm: tp": "#e45756",
    "comm: sp": "#72b7b2", "comm: pp": "#ff9da6", "comm: tp_row": "#e45756",
    "comm: tp_col": "#c44e52", "comm: tp_dep": "#8c564b", "comm: embedding": "#eeca3b"}
MAX_RANK_BARS = 16  # beyond it, one bar per pipeline stage (its ranks hold the same)
BUDGET_IN_VIEW = 3.0  # a budget line is drawn when within this factor of the tallest bar


def memory_columns(p: Prediction) -> tuple[list[str], list[Memory]]:
    """The bars' labels and memory: one per rank, or one per pipeline stage on large meshes."""
    ranks = rank_memory(p)
    if len(ranks) <= MAX_RANK_BARS:
        return [f"rank {r}" for r in range(len(ranks))], ranks
    stages = stage_memory(p)
    if len(stages) == 1:
        return [f"each of {len(ranks)} ranks"], stages
    return [f"ranks of stage {s}" for s in range(len(stages))], stages


def memory_figure(p: Prediction, budget: dict[str, float | None]) -> go.Figure:
    """Predicted bytes per rank, per tier (plots) and category (stacked), in MiB, against
    ``budget`` (``budgets``). Traces are named ``"<tier>: <category>"``."""
    labels, columns = memory_columns(p)
    titles = [f"{tier} (budget {size(budget[tier])})" if budget[tier] is not None else tier
              for tier in TIERS]
    if p.plan.device_mem is not None:  # offload's own target for model state on the device
        titles[0] += f", device_mem {size(p.plan.device_mem)}"
    fig = make_subplots(rows=1, cols=len(TIERS), subplot_titles=titles, horizontal_spacing=0.07)
    for col, tier in enumerate(TIERS, 1):
        for category in CATEGORIES:
            y = [m[tier][category] / MIB for m in columns]
            fig.add_trace(go.Bar(
                name=f"{tier}: {category}", x=labels, y=y, legendgroup=tier,
                showlegend=any(y),  # the legend lists what is drawn
                marker={"color": TIER_COLOUR[tier], "pattern": {"shape": PATTERN[category]},
                        "line": {"color": "#fff", "width": 1}},
                hovertemplate=f"%{{x}}<br>{tier} {category}: %{{y:.4g}} MiB<extra></extra>"),
                row=1, col=col)
        tallest = max(sum(m[tier].values()) for m in columns) / MIB
        limit = budget[tier]
        if limit is not None and limit / MIB <= BUDGET_IN_VIEW * max(tallest, 1e-9):
            fig.add_hline(y=limit / MIB, line={"dash": "dash", "color": "#b00020"},
                          annotation_text="budget", row=1, col=col)
    peak = p.peak_bytes
    fig.update_layout(barmode="stack", height=340, margin={"t": 70, "b": 40},
                      title=f"predicted memory per rank: {plan_label(p.plan)}, device peak "
                            f"{size(peak)}", legend={"font": {"size": 10}})
    fig.update_yaxes(title_text="MiB per rank", row=1, col=1)
    return themed(fig)


def time_figure(p: Prediction) -> go.Figure:
    """The predicted step time as one bar split into its parts (seconds), communication
    per axis as exposed (what the step waits for), the hidden seconds in the hover."""
    hidden = {f"comm: {axis}": h for axis, (_, h) in exposed_by_axis(p).items()}
    fig = go.Figure()
    for part, value in step_split(p).items():
        colour = PART_COLOUR.get(part) or AXIS_COLOUR.get(part, "#17becf")
        extra = f" exposed, {hidden[part]:.3g} s hidden" if part in hidden else ""
        fig.add_trace(go.Bar(
            name=part, x=[value], y=["step"], orientation="h", marker={"color": colour},
            hovertemplate=f"{part}: %{{x:.3g}} s{extra}<extra></extra>"))
    fig.update_layout(barmode="stack", height=200, margin={"t": 50, "b": 40},
                      title=f"predicted step time {seconds(p.step_time)}: where it goes",
                      legend={"font": {"size": 10}, "orientation": "h", "y": -0.45})
    fig.update_xaxes(title_text="s per step")
    return themed(fig)


def candidates_figure(candidates: Sequence[Prediction], budget: float,
                      recommended: Plan | None = None,
                      selected: Plan | None = None) -> go.Figure:
    """Every candidate's predicted step time (s, log axis) against its peak device memory
    (MiB): those within ``budget`` and those over it, the Pareto front over all of them
    joined, ``recommended`` and ``selected`` ringed. Clickable traces carry their plans. The
    budget line is drawn only within ``BUDGET_IN_VIEW`` of the largest candidate: an 80 GB
    budget beside plans of a few MiB would put every point in one column at x = 0."""
    fits = [c for c in candidates if c.peak_bytes <= budget]
    over = [c for c in candidates if c.peak_bytes > budget]
    points = [(c.peak_bytes, c.step_time) for c in candidates]
    front = [candidates[i] for i in pareto_front(points)]
    fig = go.Figure()
    for name, group, style in (
            ("candidates: within the budget", fits, {"color": "#4c78a8", "size": 7}),
            ("candidates: over the budget", over, {"color": "#bab0ac", "size": 6}),
            ("Pareto front", front, {"color": "#e45756", "size": 9})):
        fig.add_trace(_points(name, group, style, "lines+markers" if group is front else
                              "markers"))
    fig.add_trace(marked_trace("recommended", candidates, recommended))
    fig.add_trace(marked_trace("selected", candidates, selected))
    largest = max((c.peak_bytes for c in candidates), default=0) / MIB
    if budget / MIB <= BUDGET_IN_VIEW * max(largest, 1e-9):  # a far budget squeezes the points
        fig.add_vline(x=budget / MIB, line={"dash": "dash", "color": "#b00020"},
                      annotation_text=f"budget {size(budget)}")
    fig.update_layout(height=420, margin={"t": 60, "b": 50}, hovermode="closest",
                      title=f"{len(candidates)} candidate plans ({len(fits)} within the "
                            f"budget, {len(front)} on the Pareto front): click one to select it",
                      legend={"font": {"size": 10}})
    fig.update_xaxes(title_text="predicted peak device memory (MiB per rank)")
    fig.update_yaxes(title_text="predicted step time (s)", type="log")
    return themed(fig)


MARKS = {"recommended": {"symbol": "star", "size": 16, "color": "#54a24b"},
         "selected": {"symbol": "circle-open", "size": 18, "color": NEUTRAL_TEXT,
                      "line": {"width": 2}}}


def marked_trace(name: str, candidates: Sequence[Prediction],
                 plan: Plan | None) -> go.Scatter:
    """The ``"recommended"`` or ``"selected"`` mark: ``plan``'s point if it is a candidate
    (the same plan written out: ``to_string``), else an empty trace."""
    key = plan.to_string() if plan is not None else None
    chosen = [c for c in candidates if c.plan.to_string() == key]
    return _points(name, chosen[:1], MARKS[name], "markers")


def _points(name: str, group: Sequence[Prediction], marker: dict, mode: str) -> go.Scatter:
    group = sorted(group, key=lambda c: (c.peak_bytes, c.step_time)) if mode != "markers" \
        else list(group)
    return go.Scatter(
        name=name, mode=mode, x=[c.peak_bytes / MIB for c in group],
        y=[c.step_time for c in group], marker=marker,
        line={"color": marker.get("color"), "width": 1} if mode != "markers" else None,
        customdata=[c.plan.to_string() for c in group],
        hovertext=[plan_label(c.plan) for c in group],
        hovertemplate="%{hovertext}<br>%{y:.3g} s, %{x:.4g} MiB<extra></extra>")


def trials_figure(trials: Sequence[Trial]) -> go.Figure:
    """Measured trials: predicted against measured step time (s) and memory (MiB), with the
    line where they are equal. Failed trials are left out (the table gives their error)."""
    ok = [(i, t) for i, t in enumerate(trials, 1) if t.ok]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "step time: predicted vs measured (s)", "memory: predicted vs measured (MiB)"))
    for col, (pred, meas, scale) in enumerate(
            (("predicted_step_s", "measured_step_s", 1.0),
             ("predicted_bytes", "measured_bytes", float(MIB))), 1):
        rows = [(i, t) for i, t in ok if getattr(t, meas) is not None]
        xs = [getattr(t, meas) / scale for _, t in rows]
        ys = [getattr(t, pred) / scale for _, t in rows]
        top = max([*xs, *ys, 0.0]) * 1.1
        kind = "time" if col == 1 else "memory"
        fig.add_trace(go.Scatter(name=f"{kind}: predicted = measured", x=[0, top], y=[0, top],
                                 mode="lines", line={"dash": "dot", "color": "#888"},
                                 hoverinfo="skip", showlegend=False), row=1, col=col)
        fig.add_trace(go.Scatter(
            name=f"{kind}: trials", x=xs, y=ys, mode="markers+text",
            text=[str(i) for i, _ in rows], textposition="top center",
            hovertext=[t.plan for _, t in rows], marker={"size": 9, "color": "#4c78a8"},
            hovertemplate="%{hovertext}<br>measured %{x:.4g}, predicted %{y:.4g}"
                          "<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title_text="measured", row=1, col=col)
        fig.update_yaxes(title_text="predicted", row=1, col=col)
    fig.update_layout(height=320, margin={"t": 60, "b": 40}, showlegend=False,
                      title=f"{len(ok)} measured trial(s)")
    return themed(fig)
