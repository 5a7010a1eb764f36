"""The offload panel: where each rank's model state lives now, and what moving it costs.

Heterogeneous memory trades device memory for traffic between tiers, so the two questions a
reader has are "where is the model state?" and "what does each step move, and how long does it
wait for it?". One figure, two plots side by side:

- left, model-state bytes per tier per rank, stacked (device, host, disk), latest values: the
  ranks' ``offload.tiers`` (``kernels_runtime.telemetry``), not the process's memory, which
  the main figure shows;
- right, over time, bytes moved per step for each "from->to" pair and evictions per step (on
  their own axis, with the time waited on movement per step in the hover text), summed over
  ranks.

Ranks publish cumulative counters, so a per-step figure is a difference: between consecutive
points of a rank, moved bytes (evictions, seconds waited) over offloading steps taken, and a
point's value is the sum over ranks of each rank's latest such figure (ranks publish at
different moments; a rank that did not step since the last point keeps its figure). The title
gives the last step's totals over ranks, from each rank's ``last_step``.

A rank's offload block counts only once it has moved on during this cell
(``RunHistory.offloads``): the counters outlive a cell, so a later cell without offload would
otherwise show the previous model's placement. Traces are plain dicts, no plotly, so the
notebook's figure and the lab's dashboard page (through the pool-state file) draw the very same
ones; the two plots share one layout through two pairs of axes (domains), which plotly.py and
plotly.js both read.
"""

from __future__ import annotations

from typing import Any

from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.style import BYTES_AXIS, NEUTRAL_TEXT, colour, size, sizes

TIERS = tuple((tier, colour(tier)) for tier in ("device", "host", "disk"))
STATE, MOVED, EVICTIONS = "model state: ", "moved: ", "evictions"  # every trace's name prefix
TITLE = "model state per tier"
PAIR_ORDER = ("device->host", "host->device", "host->disk", "disk->host", "device->disk",
              "disk->device")


def _pairs(names: set[str]) -> list[str]:
    order = {p: i for i, p in enumerate(PAIR_ORDER)}
    return sorted(names, key=lambda p: (order.get(p, len(order)), p))


def per_step(history: RunHistory) -> tuple[list[float], dict[str, list[float]],
                                           list[float], list[float]]:
    """(times, {pair: bytes moved per step}, evictions per step, seconds waited per step),
    summed over ranks; see the module docstring. A point appears once some rank has a figure,
    that is from its second point with an offload block on."""
    zero: dict[str, Any] = {"moved": {}, "evictions": 0, "wait_seconds": 0.0, "steps": 0}
    previous: dict[int, dict[str, Any]] = {}  # rank -> its counters at its previous point
    rates: dict[int, dict[str, Any]] = {}  # rank -> its latest per-step figures
    rows: list[tuple[float, dict[int, dict[str, Any]]]] = []
    for point in history.points:
        changed = False
        for rank, summary in point.ranks.items():
            now = summary.get("offload") or zero
            before = previous.get(rank)
            previous[rank] = now
            steps = now["steps"] - before["steps"] if before is not None else 0
            if steps <= 0:
                continue
            moved = {pair: (n - before["moved"].get(pair, 0)) / steps
                     for pair, n in now["moved"].items()}
            rates[rank] = {"moved": moved,
                           "evictions": (now["evictions"] - before["evictions"]) / steps,
                           "wait_seconds": (now["wait_seconds"] - before["wait_seconds"]) / steps}
            changed = True
        if changed:
            rows.append((point.t, dict(rates)))
    pairs = _pairs({pair for _, r in rows for rate in r.values() for pair in rate["moved"]})
    times = [t for t, _ in rows]
    moved = {pair: [sum(rate["moved"].get(pair, 0.0) for rate in r.values()) for _, r in rows]
             for pair in pairs}
    evictions = [sum(rate["evictions"] for rate in r.values()) for _, r in rows]
    waited = [sum(rate["wait_seconds"] for rate in r.values()) for _, r in rows]
    return times, moved, evictions, waited


def offload_traces(history: RunHistory, last: int | None = None) -> dict[str, dict[str, Any]]:
    """``{trace name: plotly trace properties, "type" included}``; empty while no rank's
    offload has moved on in this cell. ``last`` keeps only the last points of the series (the
    pool-state file's bound)."""
    blocks = history.offloads()
    if not blocks:
        return {}
    labels = [f"rank {r}" for r in blocks]
    traces: dict[str, dict[str, Any]] = {}
    for tier, hue in TIERS:
        y = [int(b.get("tiers", {}).get(tier, 0)) for b in blocks.values()]
        traces[f"{STATE}{tier}"] = {
            "type": "bar", "x": labels, "y": y, "xaxis": "x", "yaxis": "y",
            "marker": {"color": hue},
            "customdata": sizes(y),
            "hovertemplate": f"%{{x}}: %{{y:,}} B (%{{customdata}}) of model state on {tier}"
                             "<extra></extra>"}
    times, moved, evictions, waited = per_step(history)
    start = -last if last else 0
    times, evictions, waited = times[start:], evictions[start:], waited[start:]
    for pair, y in moved.items():
        traces[f"{MOVED}{pair}"] = {
            "type": "scatter", "mode": "lines+markers", "x": times, "y": y[start:],
            "xaxis": "x2", "yaxis": "y2",
            "customdata": sizes(y[start:]),
            "hovertemplate": f"{pair}: %{{y:,.0f}} B (%{{customdata}}) per step (all ranks)"
                             "<extra></extra>"}
    if times:
        traces[EVICTIONS] = {
            "type": "scatter", "mode": "lines", "x": times, "y": evictions, "customdata": waited,
            "xaxis": "x2", "yaxis": "y3", "line": {"dash": "dot", "color": NEUTRAL_TEXT},
            "hovertemplate": "%{y:,.1f} evictions per step, %{customdata:.4f} s waited on "
                             "movement per step (all ranks)<extra></extra>"}
    return traces


def offload_title(history: RunHistory) -> str:
    """The panel's title: the last step's bytes moved, evictions and time waited, all ranks."""
    blocks = history.offloads()
    if not blocks:
        return f"{TITLE} (no offload in this cell)"
    last = [b.get("last_step", {}) for b in blocks.values()]
    moved = sum(sum(s.get("moved", {}).values()) for s in last)
    evictions = sum(s.get("evictions", 0) for s in last)
    waited = sum(s.get("wait_seconds", 0.0) for s in last)
    return (f"{TITLE} · {size(moved)} moved last step · {evictions:,} evictions/step · "
            f"{waited:.3f} s waited (all ranks)")


def offload_layout(history: RunHistory) -> dict[str, Any]:
    """Title and the two plots' axes: bars on x/y (left), the per-step series on x2/y2 with
    evictions on y3 (right, overlaying y2). No size, margins or legend: each page sets its own."""
    return {
        "title": {"text": offload_title(history), "font": {"size": 14}},
        "barmode": "stack",
        "xaxis": {"domain": [0.0, 0.28], "anchor": "y"},
        "yaxis": {"anchor": "x", **BYTES_AXIS, "title": {"text": "model state (now)"}},
        "xaxis2": {"domain": [0.4, 0.92], "anchor": "y2",
                   "title": {"text": "s since the cell started"}},
        "yaxis2": {"anchor": "x2", **BYTES_AXIS, "rangemode": "tozero",
                   "title": {"text": "moved per step"}},
        "yaxis3": {"anchor": "x2", "overlaying": "y2", "side": "right", "showgrid": False,
                   "rangemode": "tozero", "tickmode": "auto",  # not synced to y2's odd ticks
                   "title": {"text": "evictions per step"}},
    }
