"""``workbench.compare(run_a, run_b, ...)``: several runs in one figure, plans in the legend.

Trying plan A in one cell and plan B in the next is the reason to use a notebook; this draws
the comparison instead of leaving it to the eye. Three plots side by side: the loss curves
(smoothed as the dashboard's, eval loss dashed, log axis) over training steps, tokens/s (all
ranks) per run, and peak memory per tier (the largest rank's) per run.

A run is given as this session's kept run (``KeptRun``, an index into ``SESSION_RUNS``: ``-1``
the last, ``-2`` the one before), a ``RunHistory`` or ``LiveDashboard`` of a cell, or a run
directory (``runs.py``; read back with TensorBoard's own ``EventAccumulator``, so runs of an
earlier kernel compare too).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.ui.dashboard.curves import DEFAULT_SMOOTHING, drawn_logs, smooth
from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.runs import SESSION_RUNS, KeptRun, figures_of
from workbench.ui.dashboard.style import BYTES_AXIS, colour, sizes, themed

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class Compared:
    """What ``compare`` draws of one run."""

    name: str  # the legend: plan, or the cell's line when the plan is unknown
    loss: tuple[list[int], list[float]]  # (steps, losses)
    eval_loss: tuple[list[int], list[float]]
    tokens_per_s: float
    peak_memory: dict[str, int]  # tier -> bytes


def _from_history(history: RunHistory) -> Compared:
    drawn = drawn_logs(history.curves)
    log = next(iter(drawn.values()), None)
    empty: tuple[list[int], list[float]] = ([], [])
    figures = figures_of(history)
    return Compared(history.plan or history.label or "run",
                    log.series("loss") if log else empty,
                    log.series("eval loss") if log else empty,
                    figures["tokens_per_s"], figures["peak_memory"])


def read_run_dir(path: str | os.PathLike[str]) -> Compared:
    """A run directory written by ``runs.py``: ``run.json`` and its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    path = Path(path)
    meta_file = path / "run.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a kept run (no run.json); pass a directory "
                                "under runs/ that a %%colossal cell wrote")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    events = EventAccumulator(str(path), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags().get("tensors", []))

    def series(tag: str) -> tuple[list[int], list[float]]:
        if tag not in tags:
            return [], []
        rows = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto).item()))
                for e in events.Tensors(tag)]
        return [s for s, _ in rows], [v for _, v in rows]

    return Compared(meta.get("plan") or meta.get("label") or path.name,
                    series("train/loss"), series("eval/loss"),
                    float(meta.get("tokens_per_s", 0.0)),
                    {t: int(meta.get("peak_memory", {}).get(t, 0)) for t in TIERS})


def resolve(run: Any) -> Compared:
    """One run as ``compare`` takes it (see the module docstring)."""
    if isinstance(run, bool):
        raise TypeError("compare takes runs, not a bool")
    if isinstance(run, int):
        if not SESSION_RUNS or not -len(SESSION_RUNS) <= run < len(SESSION_RUNS):
            raise IndexError(f"no run {run} in this session: {len(SESSION_RUNS)} kept so far "
                             "(a %%colossal cell that calls train_step keeps one); pass a run "
                             "directory to compare runs of an earlier kernel")
        run = SESSION_RUNS[run]
    if isinstance(run, KeptRun):
        if run.history is not None:
            return _from_history(run.history)
        run = run.wait()
    history = getattr(run, "history", run)  # a LiveDashboard's
    if isinstance(history, RunHistory):
        return _from_history(history)
    if isinstance(run, (str, os.PathLike)):
        return read_run_dir(run)
    raise TypeError(f"compare cannot take {type(run).__name__}: pass kept runs (an index "
                    "such as -1, a KeptRun), a cell's RunHistory, or run directories")


def compare(*runs: Any, smoothing: float = DEFAULT_SMOOTHING) -> Any:
    """A plotly figure overlaying ``runs`` (default: this session's last two kept runs)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not runs:
        runs = tuple(range(-min(2, len(SESSION_RUNS)), 0)) or (-1,)
    got = [resolve(r) for r in runs]
    names = [f"{c.name} (#{i + 1})" if [x.name for x in got].count(c.name) > 1 else c.name
             for i, c in enumerate(got)]
    fig = make_subplots(rows=1, cols=3, column_widths=[0.5, 0.2, 0.3], horizontal_spacing=0.08,
                        subplot_titles=("loss (log; eval dashed)", "tokens/s (all ranks)",
                                        "peak memory per tier (largest rank)"))
    for i, (run, name) in enumerate(zip(got, names)):
        hue = colour(f"run {i + 1}")
        steps, loss = run.loss
        fig.add_trace(go.Scatter(x=steps, y=smooth(loss, smoothing) if loss else [],
                                 name=name, legendgroup=name, mode="lines",
                                 # the first run wide and faint: a run with the very same
                                 # losses (another plan's parity) still shows under it
                                 line={"color": hue, "width": 6 if i == 0 else 2},
                                 opacity=0.5 if i == 0 and len(got) > 1 else 1.0,
                                 hovertemplate=f"{name}<br>step %{{x}}: loss %{{y:.5g}} "
                                               "(smoothed)<extra></extra>"), row=1, col=1)
        if run.eval_loss[0]:
            fig.add_trace(go.Scatter(x=run.eval_loss[0], y=run.eval_loss[1],
                                     name=f"{name}: eval", legendgroup=name, showlegend=False,
                                     mode="lines+markers", line={"color": hue, "dash": "dash"},
                                     hovertemplate=f"{name}<br>step %{{x}}: eval loss "
                                                   "%{y:.5g}<extra></extra>"),
                          row=1, col=1)
        fig.add_trace(go.Bar(x=[name], y=[run.tokens_per_s], name=f"{name}: tokens/s",
                             legendgroup=name, showlegend=False, marker={"color": hue},
                             hovertemplate=f"{name}: %{{y:,.1f}} tokens/s<extra></extra>"),
                      row=1, col=2)
        peak = [run.peak_memory.get(t, 0) for t in TIERS]
        fig.add_trace(go.Bar(x=list(TIERS), y=peak, customdata=sizes(peak),
                             name=f"{name}: peak memory", legendgroup=name, showlegend=False,
                             marker={"color": hue},
                             hovertemplate=f"{name}, %{{x}}: %{{y:,}} B (%{{customdata}})"
                                           "<extra></extra>"), row=1, col=3)
    themed(fig)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_yaxes(tickformat="~s", ticksuffix=" tok/s", rangemode="nonnegative", row=1, col=2)
    fig.update_yaxes(BYTES_AXIS, row=1, col=3)
    fig.update_xaxes(title_text="training step", row=1, col=1)
    fig.update_xaxes(showticklabels=False, row=1, col=2)
    fig.update_layout(barmode="group", height=420, title=f"{len(got)} runs compared",
                      legend={"orientation": "h", "y": -0.2})
    return fig
