"""The pipeline stage panel: which micro-batch each pipeline rank ran when, and when it idled.

A pipeline's cost is its bubble, and a bubble is easiest to see on a timeline. One row per
rank that published a pipeline step ("rank 1 · stage 1"), drawn on that rank's own clock from
the start of its last published step (``kernels_runtime.telemetry.timeline``):

- a bar per action, coloured by kind (F forward, B backward, W weight gradients under zbv)
  and labelled by micro-batch ("3", or "3.1" for chunk 1 when ranks hold several chunks);
- a grey bar for the receive wait before an action: the rank was idle, waiting on its peer;
- blank space where the rank ran no action (the step's tail: gradient reduction, the loss
  all-reduce).

The title gives each rank's bubble (receive wait / step time, the executor's figure). Traces
are plain dicts, no plotly, so the notebook's figure and the lab's dashboard page (through the
pool-state file) draw the very same bars.
"""

from __future__ import annotations

from typing import Any

from workbench.ui.dashboard.style import colour

KINDS = tuple((kind, what, colour(kind))
              for kind, what in (("F", "forward"), ("B", "backward"), ("W", "weight grads")))
IDLE_NAME, IDLE_COLOUR = "stage: idle (waiting on a receive)", colour("idle")
PREFIX = "stage: "  # every trace of the panel is named "stage: ..."


def row_label(rank: int, timeline: dict[str, Any]) -> str:
    return f"rank {rank} · stage {timeline.get('stage', '?')}"


def _bar(colour: str, width: float) -> dict[str, Any]:
    return {"orientation": "h", "y": [], "x": [], "base": [], "text": [], "hovertext": [],
            "hoverinfo": "text", "textposition": "inside", "insidetextanchor": "middle",
            "width": width, "marker": {"color": colour, "line": {"width": 1, "color": "#fff"}}}


def stage_traces(timelines: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{trace name: horizontal-bar properties}`` for ``{rank: published timeline}``; empty
    without a pipeline. A bar's ``base`` is where it starts and ``x`` its length (seconds)."""
    names = {kind: f"{PREFIX}{kind} ({what})" for kind, what, _ in KINDS}
    traces = {names[kind]: _bar(colour, 0.8) for kind, _, colour in KINDS}
    idle = traces[IDLE_NAME] = _bar(IDLE_COLOUR, 0.4)
    for rank, timeline in timelines.items():
        row, several = row_label(rank, timeline), timeline.get("chunks", 1) > 1
        for e in timeline.get("events", ()):
            began = e["start"] + e["wait"]
            label = f"{e['mb']}.{e['chunk']}" if several else str(e["mb"])
            where = (f"rank {rank}, {e['kind']} of micro-batch {e['mb']} (chunk {e['chunk']}, "
                     f"virtual stage {e['stage']})")
            if e["wait"] > 0:
                _add(idle, row, e["start"], e["wait"], "",
                     f"{where}: waited {e['wait'] * 1e3:.2f} ms on a receive")
            bar = traces.get(names.get(e["kind"], ""))
            if bar is not None:
                _add(bar, row, began, max(0.0, e["end"] - began), label,
                     f"{where}: {began * 1e3:.2f}-{e['end'] * 1e3:.2f} ms")
    return {name: t for name, t in traces.items() if t["y"]}


def _add(trace: dict[str, Any], row: str, base: float, length: float, text: str,
         hover: str) -> None:
    for key, value in (("y", row), ("base", base), ("x", length), ("text", text),
                       ("hovertext", hover)):
        trace[key].append(value)


def stage_title(timelines: dict[int, dict[str, Any]]) -> str:
    """The panel's title: schedule, micro-batches and each rank's bubble."""
    if not timelines:
        return "pipeline stages (no pipeline in this cell)"
    first = next(iter(timelines.values()))
    steps = sorted({t.get("step", 0) for t in timelines.values()})
    step = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    bubbles = ", ".join(f"rank {r} {t.get('bubble', 0.0):.0%}" for r, t in timelines.items())
    return (f"pipeline stages, {step} ({first.get('schedule', '')}, "
            f"{first.get('microbatches', 0)} micro-batches); bubble: {bubbles}")


def stage_axes(timelines: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(x axis, y axis) properties: seconds from the step's start to its end, rank 0 on top."""
    end = max((t.get("step_seconds", 0.0) for t in timelines.values()), default=0.0)
    x = {"title": {"text": "s since the rank's step began"}, "tickformat": ".3~f",
         "range": [0, end * 1.02 if end > 0 else 1.0]}
    rows = [row_label(r, t) for r, t in timelines.items()]
    y = {"type": "category", "categoryorder": "array", "categoryarray": rows,
         "autorange": "reversed"}
    return x, y
