"""The curves panel: loss and eval loss (log axis), learning rate and gradient norm per step.

Ranks publish a rolling window of their last training steps (``kernels_runtime.telemetry.
curves``); ``CurveLog`` merges the windows by step number, so the notebook keeps every step it
has seen once, however often the same window arrives. The panel draws, like TensorBoard's
scalars page, each series raw (faint) and smoothed by TensorBoard's slider: a debiased
exponential moving average with weight ``smoothing`` (0 = raw; TensorBoard's default 0.6).
The learning rate is a schedule, not a noisy measurement, so it is drawn as it is.

The loss is averaged over data-parallel ranks and the grad norm is global, so ranks agree; the
panel draws the first rank's curves and adds another rank's only where its values differ (a
pipeline's first stage, say, has no loss of its own to report in another setup). Loss scale
and skipped steps (fp16) are in the title. Traces are plain dicts, no plotly, so the notebook's
figure and the lab's dashboard page (through the pool-state file) draw the very same ones; the
three plots share one layout through three pairs of axes (domains), as ``offload.py`` does.
Smoothed traces carry ``meta: {"smooth_of": raw trace name}`` so the lab page's slider can
smooth the raw series again without a round trip to the kernel.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.ui.dashboard.style import colour

PREFIX = "curves: "  # every trace of the panel is named "curves: ..."
DEFAULT_SMOOTHING = 0.6  # TensorBoard's default
MAX_DRAWN = 1000  # points drawn per series (every n-th beyond that); the run keeps them all
SERIES = (("loss", "x", "y"), ("eval loss", "x", "y"), ("lr", "x2", "y2"),
          ("grad norm", "x3", "y3"))  # coloured by ``style.colour``: the series, or the rank


class CurveLog:
    """One rank's training curves as the notebook saw them: every published step, merged."""

    def __init__(self) -> None:
        self.train: dict[int, dict[str, Any]] = {}  # step -> {loss, lr, grad_norm, ...}
        self.eval: dict[tuple[int, int], float] = {}  # (step, nth eval at that step) -> loss
        self.steps = 0
        self.skipped = 0

    def ingest(self, block: Any) -> bool:
        """Merge one published ``curves`` block; True if it held a step not seen before."""
        if not isinstance(block, dict):
            return False
        new = False
        for row in block.get("train", []):
            step = int(row[0])
            if step not in self.train:
                new = True
                self.train[step] = {"loss": row[1], "lr": row[2], "grad_norm": row[3],
                                    "loss_scale": row[4], "stepped": bool(row[5])}
        seen: dict[int, int] = {}
        for step, loss in block.get("eval", []):
            nth = seen[step] = seen.get(step, -1) + 1
            if (step, nth) not in self.eval:
                new = True
                self.eval[(int(step), nth)] = loss
        self.steps = max(self.steps, int(block.get("steps", 0)))
        self.skipped = max(self.skipped, int(block.get("skipped", 0)))
        return new

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``loss``, ``lr``, ``grad_norm``, ``loss_scale`` or ``eval loss``,
        steps in order, missing values (no grad norm without clipping) left out."""
        if key == "eval loss":
            items = sorted(self.eval.items())
            return [s for (s, _), _ in items], [v for _, v in items]
        steps = sorted(self.train)
        pairs = [(s, self.train[s][key]) for s in steps if self.train[s][key] is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]


def smooth(values: list[float], weight: float = DEFAULT_SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points
    are not pulled towards 0; non-finite values pass through unsmoothed."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing must be in [0, 1) (TensorBoard's slider), got {weight}")
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last, n = last * weight + (1.0 - weight) * v, n + 1
        out.append(last / (1.0 - weight ** n))
    return out


def _thin(x: list, y: list) -> tuple[list, list]:
    if len(x) <= MAX_DRAWN:
        return x, y
    every = math.ceil(len(x) / MAX_DRAWN)
    keep = list(range(0, len(x), every))
    if keep[-1] != len(x) - 1:
        keep.append(len(x) - 1)
    return [x[i] for i in keep], [y[i] for i in keep]


def drawn_logs(logs: dict[int, CurveLog]) -> dict[int, CurveLog]:
    """The ranks whose curves are drawn: the first rank with data, and any other whose losses
    differ from it."""
    ranks = [r for r in sorted(logs) if logs[r].train or logs[r].eval]
    if not ranks:
        return {}
    first = logs[ranks[0]]
    keep = {ranks[0]: first}
    for r in ranks[1:]:
        if logs[r].series("loss") != first.series("loss"):
            keep[r] = logs[r]
    return keep


def curve_traces(logs: dict[int, CurveLog], smoothing: float = DEFAULT_SMOOTHING,
                 last: int | None = None) -> dict[str, dict[str, Any]]:
    """``{trace name: plotly trace properties, "type" included}``; empty while no rank has
    published a curve. ``last`` keeps only the last points of each series."""
    drawn = drawn_logs(logs)
    traces: dict[str, dict[str, Any]] = {}
    for rank, log in drawn.items():
        suffix = f" (rank {rank})" if len(drawn) > 1 else ""
        for what, xa, ya in SERIES:
            # one rank drawn: a colour per series; several: each rank its own colour (as in
            # every panel), eval loss dashed beside its loss
            hue = colour(rank) if len(drawn) > 1 else colour(what)
            dash = "dash" if len(drawn) > 1 and what == "eval loss" else "solid"
            x, y = log.series(what.replace(" norm", "_norm"))
            if last:
                x, y = x[-last:], y[-last:]
            if not x:
                continue
            x, y = _thin(x, y)
            raw = f"{PREFIX}{what}{suffix}"
            unit = "" if what == "lr" else " "
            mode = "lines+markers" if len(x) < 50 else "lines"
            if what == "lr":  # a schedule, not a noisy measurement: drawn as it is
                traces[raw] = {"type": "scatter", "mode": mode, "x": x, "y": y, "xaxis": xa,
                               "yaxis": ya, "line": {"color": hue, "shape": "hv"},
                               "hovertemplate": "step %{x}: lr %{y:.4g}<extra></extra>"}
                continue
            traces[raw] = {"type": "scatter", "mode": mode,
                           "x": x, "y": y, "xaxis": xa, "yaxis": ya, "opacity": 0.3,
                           "line": {"color": hue, "dash": dash}, "showlegend": False,
                           "hovertemplate": f"step %{{x}}: {what}{unit}%{{y:.5g}} (raw)"
                                            "<extra></extra>"}
            traces[f"{raw} (smoothed)"] = {
                "type": "scatter", "mode": "lines", "x": x, "y": smooth(y, smoothing),
                "xaxis": xa, "yaxis": ya, "line": {"color": hue, "dash": dash},
                "meta": {"smooth_of": raw},
                "hovertemplate": f"step %{{x}}: {what}{unit}%{{y:.5g}} (smoothed)<extra></extra>"}
    return traces


def curve_title(logs: dict[int, CurveLog], smoothing: float = DEFAULT_SMOOTHING) -> str:
    """The panel's title: the last loss, eval loss, loss scale and skipped steps."""
    drawn = drawn_logs(logs)
    if not drawn:
        return "training curves (no train_step in this cell yet)"
    log = next(iter(drawn.values()))
    parts = [f"step {log.steps}"]
    _, loss = log.series("loss")
    if loss:
        parts.append(f"loss {loss[-1]:.4g}")
    _, evals = log.series("eval loss")
    if evals:
        parts.append(f"eval loss {evals[-1]:.4g}")
    _, scale = log.series("loss_scale")
    if scale:
        parts.append(f"loss scale {scale[-1]:g}")
    parts.append(f"{log.skipped} skipped step{'s' if log.skipped != 1 else ''}")
    return f"training curves · {' · '.join(parts)} · smoothing {smoothing:g}"


def curve_layout(logs: dict[int, CurveLog], smoothing: float = DEFAULT_SMOOTHING
                 ) -> dict[str, Any]:
    """Title and the three plots' axes: loss and eval loss on x/y (log), LR on x2/y2, grad
    norm on x3/y3. No size, margins or legend: each page sets its own."""
    step = {"text": "training step (this cell)"}
    # without clipping no grad norm is measured: the LR plot takes its place
    norms = any(log.series("grad_norm")[0] for log in drawn_logs(logs).values())
    return {
        "title": {"text": curve_title(logs, smoothing), "font": {"size": 14}},
        "xaxis": {"domain": [0.0, 0.42], "anchor": "y", "title": step},
        "yaxis": {"anchor": "x", "type": "log", "title": {"text": "loss (log)"}},
        "xaxis2": {"domain": [0.52, 0.74 if norms else 1.0], "anchor": "y2", "title": step},
        # from 0: plotly pads a constant series to [v - 1, v + 1], so a fixed lr of 1e-2 was
        # drawn as a flat line at "0" on a -1..1 axis (seen on the lab page, issue 33)
        "yaxis2": {"anchor": "x2", "tickformat": ".3~g", "rangemode": "tozero",
                   "title": {"text": "learning rate"}},
        "xaxis3": {"domain": [0.82, 1.0], "anchor": "y3", "title": step, "visible": norms},
        "yaxis3": {"anchor": "x3", "rangemode": "tozero", "visible": norms,
                   "title": {"text": "grad norm (set max_grad_norm to measure it)"
                             if not norms else "grad norm"}},
    }
