"""HTML of the tuner's panes: a prediction, an error, the trials table.

Plain HTML in ``ipywidgets.HTML``: it updates in place as controls move and reads the same in a
saved notebook. Numbers use binary MiB/GiB like the dashboard.
"""

from __future__ import annotations

import html

from workbench.planner.cost_model import Prediction, plan_label
from workbench.planner.setting import CATEGORIES, TIERS
from workbench.tuner.trials import Trial

_TABLE = "border-collapse:collapse;font-size:12px"
_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:right"


def size(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def seconds(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def percent(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:+.0f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th style='{_CELL}'>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td style='{_CELL}'>{c}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table style='{_TABLE}'><tr>{head}</tr>{body}</table>"


def error_html(message: str) -> str:
    """The plan's problem in the validator's own words."""
    return ("<div style='color:#b00020'><b>Invalid plan:</b> "
            f"<span class='workbench-plan-error'>{html.escape(message)}</span></div>")


def prediction_html(p: Prediction, hardware: str, budget: float | None = None) -> str:
    """Validity, peak memory per tier and category, and the step time split."""
    peak = p.peak_by_tier()
    fits = ""
    if budget is not None:
        ok = p.peak_bytes <= budget
        fits = (f" — <b style='color:{'#1b7f3b' if ok else '#b00020'}'>"
                f"{'fits' if ok else 'exceeds'} the {size(budget)} budget</b>")
    header = (f"<div><b style='color:#1b7f3b'>Valid:</b> <code>{html.escape(plan_label(p.plan))}"
              f"</code> on {p.setting.world} ranks, {html.escape(hardware)}: "
              f"<b>{seconds(p.step_time)}</b> per step, peak <b>{size(p.peak_bytes)}</b> "
              f"per rank{fits}</div>")
    mem_rows = [[tier] + [size(p.memory_by_category(tier)[c]) for c in CATEGORIES]
                + [size(peak[tier])] for tier in TIERS]
    memory = _table(["tier", *CATEGORIES, "total"], mem_rows)
    exposed = p.exposed_comm_time
    bubble = [seconds(p.bubble_time)] if p.pipeline is not None else []
    time_rows = [[seconds(p.compute_time), seconds(exposed), seconds(p.comm_time - exposed),
                  seconds(p.seconds("optimizer")), seconds(p.seconds("overhead")), *bubble,
                  seconds(p.step_time)]]
    timing = _table(["compute", "exposed comm", "hidden comm", "optimizer", "overhead",
                     *(["pipeline bubble"] if bubble else []), "step"], time_rows)
    return (f"{header}<div>{memory}</div><div style='margin-top:4px'>{timing}</div>"
            f"{pipeline_html(p)}")


def pipeline_html(p: Prediction) -> str:
    """Under pp: the schedule's shape per stage, and which stage the numbers above are of."""
    s = p.pipeline
    if s is None:
        return ""
    share = p.bubble_time / p.step_time if p.step_time else 0.0
    return (f"<div class='workbench-pipeline' style='margin-top:4px'>pipeline: "
            f"<b>{html.escape(s.schedule)}</b> over {s.stages} stages, {s.chunks} chunk(s) per "
            f"rank, {s.microbatches} micro-batches: bubble <b>{share:.1%}</b> of the step; "
            f"blocks per stage {list(s.blocks)}, micro-batch chunks in flight per stage "
            f"{list(s.held)}; memory of stage {s.memory_rank} (the largest: "
            f"{', '.join(size(b) for b in s.rank_peak)}), time of stage {s.time_rank}</div>")


def trials_html(trials: list[Trial]) -> str:
    if not trials:
        return "<i>No trials yet: press Measure to run the plan on the pool.</i>"
    rows = []
    for i, t in enumerate(trials, 1):
        status = "ok" if t.ok else html.escape(t.error or "not run")
        rows.append([str(i), f"<code>{html.escape(t.plan)}</code>", html.escape(t.hardware),
                     seconds(t.predicted_step_s), seconds(t.measured_step_s),
                     percent(t.time_error()), size(t.predicted_bytes), size(t.measured_bytes),
                     percent(t.memory_error()), status])
    return _table(["#", "plan", "predicted on", "pred step", "meas step", "err", "pred memory",
                   "meas memory", "err", "status"], rows)
