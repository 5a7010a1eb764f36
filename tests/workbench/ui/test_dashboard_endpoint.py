"""The dashboard's endpoint panel: what a serving endpoint answered, as rates over time.

What is protected: requests/s is the rate of the server's request counter over the last
``RATE_WINDOW_S`` seconds (so it falls to 0 once clients stop, and a first sample says 0, not
infinity), failed requests/s likewise for statuses >= 400, in flight and the share of KV blocks
in use are the samples' own; the traces carry exactly those numbers, one name per trace; the
title (and the plain line of ``--status`` and the sidebar) names the address, state, rates,
queue and KV blocks, and a failure; the series is bounded like a run's; the pool-state file's
block holds the figures and the panel's last points. A serving dashboard shows the endpoint
figure on top of the run's, moves it on its own when the ranks publish nothing new, and its
report holds it. The real server feeding it: ``tests/workbench/serving/test_serving.py``.
"""

from __future__ import annotations

import pytest

from workbench.ui.dashboard import Dashboard, RunHistory
from workbench.ui.dashboard.endpoint import (
    RATE_WINDOW_S,
    EndpointHistory,
    EndpointSample,
    endpoint_traces,
)
from workbench.ui.dashboard.figures import build_endpoint_figure, trace_data

from helpers.reports import report_traces

URL = "http://127.0.0.1:8123/v1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample(requests: float, failed: float = 0, in_flight: int = 3, **kw) -> EndpointSample:
    figures = dict(running=2, waiting=1, kv_used=24, kv_total=96)
    figures.update(kw)
    return EndpointSample(requests, failed, in_flight, **figures)


def _served(clock: Clock, counts: list[tuple[float, float]], step: float = 0.5,
            **kw) -> EndpointHistory:
    """An endpoint sampled every ``step`` seconds with (requests, failed) counts."""
    history = EndpointHistory(URL, "engine", replicas=2, clock=clock, **kw)
    for requests, failed in counts:
        clock.now += step
        history.sample(_sample(requests, failed))
    return history


def test_requests_per_second_is_the_counters_rate_over_the_window() -> None:
    clock = Clock()
    history = _served(clock, [(0, 0)])
    assert history.points[0].requests_per_s == 0.0  # one count: no rate yet, not infinity
    for i in range(1, 31):  # 15 s: 2 requests per 0.5 s, one in ten of them failing
        clock.now += 0.5
        history.sample(_sample(2 * i, 0.2 * i))
    assert history.points[1].requests_per_s == pytest.approx(4.0)  # over 0.5 s at first
    assert [p.requests_per_s for p in history.points[1:]] == pytest.approx([4.0] * 30)
    assert history.points[-1].failed_per_s == pytest.approx(0.4)
    for _ in range(int(RATE_WINDOW_S / 0.5)):  # the clients stop: the rate falls to 0
        clock.now += 0.5
        history.sample(_sample(60, 6))
    falling = [p.requests_per_s for p in history.points[-10:]]
    assert falling == sorted(falling, reverse=True) and falling[0] > 0 and falling[-1] == 0
    assert history.points[-1].t == pytest.approx(20.5)
    assert history.points[-1].kv_percent == pytest.approx(25.0)


def test_traces_title_and_line_carry_the_samples() -> None:
    clock = Clock()
    history = _served(clock, [(0, 0), (3, 0), (6, 1)])
    fig = build_endpoint_figure(history, widget=False)
    data = trace_data(fig)
    assert [t.name for t in fig.data] == list(data) == [
        "endpoint: requests/s", "endpoint: failed requests/s", "endpoint: in flight",
        "endpoint: KV blocks used (%)"]
    times = [0.5, 1.0, 1.5]
    assert data["endpoint: requests/s"] == (times, [0.0, 6.0, 6.0])
    assert data["endpoint: failed requests/s"] == (times, [0.0, 0.0, 1.0])
    assert data["endpoint: in flight"] == (times, [3, 3, 3])
    assert data["endpoint: KV blocks used (%)"] == (times, [25.0, 25.0, 25.0])
    assert fig.layout.title.text == (
        f"endpoint engine at {URL}: serving, 6.0 requests/s, 3 in flight<br>engines (2 "
        "replicas): 2 running, 1 waiting, KV blocks 24 of 96 (25%) · 6 requests, 1 failed")
    assert history.line() == fig.layout.title.text.replace("<br>", "; ")

    clock.now += 0.5
    history.sample(_sample(6, 1, in_flight=0, status="failed",
                          failure="rank 1 on h died; run `%colossal restart`"))
    assert history.line().endswith("; unavailable: rank 1 on h died; run `%colossal restart`")
    assert ": failed, " in history.line()


def test_the_series_is_bounded_and_the_state_block_keeps_the_last_points() -> None:
    clock = Clock()
    history = _served(clock, [(i, 0) for i in range(25)], max_points=10)
    assert len(history.points) <= 10 and history.points[-1].t == pytest.approx(12.5)
    block = history.block(last=4)
    assert {k: block[k] for k in ("url", "engine", "model", "replicas", "status", "failure",
                                  "requests", "in_flight", "running", "waiting", "kv_used",
                                  "kv_total")} == {
        "url": URL, "engine": "engine", "model": "engine", "replicas": 2, "status": "serving",
        "failure": None, "requests": 24, "in_flight": 3, "running": 2, "waiting": 1,
        "kv_used": 24, "kv_total": 96}
    assert block["requests_per_s"] == pytest.approx(2.0) and block["line"] == history.line()
    traces = {t["name"]: t for t in block["panel"]["traces"]}
    assert traces == {name: {"name": name, **props}
                      for name, props in endpoint_traces(history, last=4).items()}
    assert traces["endpoint: requests/s"]["x"] == [round(p.t, 3) for p in history.points[-4:]]
    assert block["panel"]["layout"]["yaxis3"]["overlaying"] == "y2"
    fresh = EndpointHistory(URL, "engine")
    assert fresh.block() is None  # not sampled yet
    fresh.sample(_sample(0, kv_used=0, kv_total=0))  # no engine has stepped
    assert "1 waiting, KV blocks not reported yet · 0 requests" in fresh.line()
    assert fresh.line(_sample(7)).endswith("KV blocks 24 of 96 (25%) · 7 requests, 0 failed")


def test_a_serving_dashboard_shows_the_endpoint_on_top(tmp_path) -> None:
    clock = Clock()
    endpoint = _served(clock, [(0, 0)])
    view = Dashboard(RunHistory([0, 1], label=f"serving engine at {URL}"), endpoint=endpoint)
    assert view.widget.children == (view.endpoint_figure, view.figure)
    for i in range(1, 4):
        clock.now += 0.5
        endpoint.sample(_sample(5 * i))
        view.refresh(endpoint_only=True)  # the ranks published nothing new
    assert trace_data(view.endpoint_figure) == trace_data(
        build_endpoint_figure(endpoint, widget=False))  # updated in place: the same data
    assert trace_data(view.endpoint_figure)["endpoint: requests/s"][1] == [0, 10, 10, 10]
    assert view.endpoint_figure.layout.title.text.startswith(
        f"endpoint engine at {URL}: serving, 10.0 requests/s")
    text = view._repr_mimebundle_()["text/plain"]
    assert text.splitlines()[0] == f"colossal {endpoint.line()}"
    report = view.to_html(tmp_path / "serving.html")
    assert report_traces(report)["endpoint: requests/s"][1] == [0, 10, 10, 10]  # on top
    plain = Dashboard(RunHistory([0]))
    assert plain.widget.children == (plain.figure,)  # no endpoint: as before
