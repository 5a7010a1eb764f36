"""The live dashboard's redraws are cheap and rate-limited, and lose nothing.

What is protected: updating a shown figure hands plotly only what changed since the last update
(``figures._update_trace`` / ``_update_layout``), yet after any sequence of updates the figure
equals one built afresh from the same history (traces and layout); ``LiveDashboard`` redraws
at most every ``MIN_REDRAW_S`` however often data arrives, while ingesting every poll, so the
final redraw shows every training step the ranks published. (What this costs a training cell
is measured by ``python -m bench magic_overhead``; no time is asserted here.)
"""

from __future__ import annotations

from kernels_runtime.telemetry import TELEMETRY_KEY, Telemetry
from workbench.ui.dashboard import LiveDashboard
from workbench.ui.dashboard.figures import (
    build_curve_figure,
    build_figure,
    trace_data,
    update_curve_figure,
    update_figure,
)
from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.live import MIN_REDRAW_S


def _ranks() -> list[Telemetry]:
    return [Telemetry(None, memory=lambda r=r: {"host_rss": 1000 + r, "host_peak": 2000 + r})
            for r in range(2)]


def _poll(tels: list[Telemetry], step: int) -> dict[int, dict]:
    """One training step on both ranks, then what a poll of the notebook receives."""
    for tel in tels:
        tel.record_train(2.0 / (step + 1), True, 0.5 + step, 1e-3 / (step + 1), None)
    return {r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": step, "time": 0.1 * step,
                                "throughput": {"tokens_per_s": 100.0 + step}}}
            for r, tel in enumerate(tels)}


def test_updated_figures_equal_figures_built_afresh() -> None:
    history, tels = RunHistory([0, 1], label="redraw", plan="dp=2"), _ranks()
    history.ingest(_poll(tels, 0))
    main, curves = build_figure(history, widget=False), build_curve_figure(history, widget=False)
    for step in range(1, 12):
        history.ingest(_poll(tels, step))
        if step % 3 == 0:  # some updates skipped, as a rate-limited redraw does
            update_figure(main, history)
            update_curve_figure(curves, history, smoothing=0.3 if step > 6 else 0.6)
    update_figure(main, history)
    update_curve_figure(curves, history, smoothing=0.3)
    fresh = build_curve_figure(history, widget=False, smoothing=0.3)
    assert trace_data(main) == trace_data(build_figure(history, widget=False))
    assert trace_data(curves) == trace_data(fresh)
    assert curves.layout.to_plotly_json() == fresh.layout.to_plotly_json()
    assert "step 12" in curves.layout.title.text
    assert len(trace_data(curves)["curves: loss"][0]) == 12


def test_live_dashboard_redraws_at_a_limited_rate_and_ends_with_every_step() -> None:
    clock = [0.0]
    live = LiveDashboard([0, 1], mode="on", display=lambda view: view.widget,  # as shown
                         clock=lambda: clock[0])
    tels = _ranks()
    live.start()
    polls = 12
    for step in range(polls):  # polls 0.1 s apart: a redraw at most every MIN_REDRAW_S
        clock[0] = 0.1 * step
        live(_poll(tels, step), False)
    # drawn at 0.0, then at the first poll at least MIN_REDRAW_S later: 0.3, 0.6, 0.9
    assert live.refreshes == 1 + int(0.1 * (polls - 1) / (3 * 0.1)) == 4 \
        and MIN_REDRAW_S == 0.25
    assert len(trace_data(live.view.curve_figure)["curves: loss"][0]) == 10  # drawn at 0.9
    live({r: {TELEMETRY_KEY: tel.snapshot()} for r, tel in enumerate(tels)}, True)
    shown = trace_data(live.view.curve_figure)
    assert shown == trace_data(build_curve_figure(live.history, widget=False))
    assert shown["curves: loss"][0] == list(range(1, polls + 1))  # no step lost
