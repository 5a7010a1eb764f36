"""The endpoint panel: what a serving endpoint answers, as its clients see it.

While ``%colossal serve`` runs, no cell runs: the ranks serve in a background task. The
inference panel shows the engines (generated tokens/s, the queue and KV blocks per replica,
from the ranks' telemetry); this panel shows the HTTP side, which only the server in the
notebook's process counts (``workbench.serving.metrics``):

- left, requests per second over time (every ``/v1`` request answered, a rate of the server's
  counter over the last ``RATE_WINDOW_S`` seconds, so it falls to 0 when the clients stop,
  where the ranks' throughput window keeps its last value) and, dotted, failed requests per
  second (status 4xx and 5xx, and 499 for a client that went away);
- right, requests in flight (sent to the engines and not finished) and, on a second axis, the
  share of the engines' KV blocks in use, all replicas together.

Its title is the endpoint's one line: address, state, requests/s, in flight, the engines' queue
and KV blocks; ``line()`` gives it as plain text for ``%colossal serve --status``, the
notebook's text output and the sidebar. Samples are plain numbers (``EndpointSample``, taken
from the server by ``workbench.serving.display``); no plotly and no server here, so the
notebook's figure, the pool-state file and the lab's dashboard page draw the same traces.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from workbench.ui.dashboard.history import append_bounded
from workbench.ui.dashboard.style import NEUTRAL_TEXT

PREFIX = "endpoint: "  # every trace of the panel is named "endpoint: ..."
RATE_WINDOW_S = 5.0
STATUSES = ("serving", "failed", "stopping", "stopped")


@dataclass(frozen=True)
class EndpointSample:
    """The server's counts at one moment."""

    requests: float  # HTTP requests answered so far, every route (a counter)
    failed: float  # of which with a status >= 400
    in_flight: int  # requests sent to the engines and not finished
    running: int  # requests running in the engines (all replicas)
    waiting: int  # requests waiting in the engines
    kv_used: int  # KV blocks in use (all replicas)
    kv_total: int
    status: str = "serving"  # one of STATUSES
    failure: str | None = None  # why the ranks cannot serve (status "failed")


@dataclass(frozen=True)
class EndpointPoint:
    t: float  # seconds since serving started, notebook clock
    requests_per_s: float
    failed_per_s: float
    in_flight: int
    kv_percent: float


class EndpointHistory:
    """An endpoint's samples: the latest, and a bounded series of rates (beyond ``max_points``
    every other point is dropped, as ``RunHistory`` does)."""

    def __init__(self, url: str, engine: str, *, model: str | None = None, replicas: int = 1,
                 window_s: float = RATE_WINDOW_S, max_points: int = 600,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.engine, self.model = url, engine, model or engine
        self.replicas, self.window_s, self.max_points = replicas, window_s, max_points
        self.clock = clock
        self.started = clock()
        self.latest: EndpointSample | None = None
        self.points: list[EndpointPoint] = []
        self._counts: deque[tuple[float, float, float]] = deque()  # (t, requests, failed)

    def sample(self, s: EndpointSample) -> EndpointPoint:
        """Take the server's counts now; the point added (rates over the window)."""
        t = self.clock() - self.started
        self._counts.append((t, s.requests, s.failed))
        while len(self._counts) > 2 and self._counts[1][0] <= t - self.window_s:
            self._counts.popleft()  # keep one count at or before the window's start
        t0, requests0, failed0 = self._counts[0]
        span = t - t0

        def rate(now: float, then: float) -> float:
            return max(0.0, now - then) / span if span > 0 else 0.0

        kv = 100.0 * s.kv_used / s.kv_total if s.kv_total else 0.0
        point = EndpointPoint(t, rate(s.requests, requests0), rate(s.failed, failed0),
                              s.in_flight, kv)
        self.latest = s
        self.points = append_bounded(self.points, point, self.max_points)
        return point

    @property
    def requests_per_s(self) -> float:
        return self.points[-1].requests_per_s if self.points else 0.0

    def line(self, sample: EndpointSample | None = None) -> str:
        """The endpoint in one line of plain text (the panel's title without its breaks):
        the latest sample's counts, or ``sample``'s (fresher, taken in another thread), with
        the latest rate."""
        return endpoint_title(self, sample).replace("<br>", "; ")

    def block(self, last: int | None = None) -> dict[str, Any] | None:
        """The endpoint for the pool-state file: its figures now, its one line and its panel
        (traces and layout, the series' ``last`` points); None before the first sample."""
        if self.latest is None:
            return None
        layout = endpoint_layout(self)
        return {
            "url": self.url, "engine": self.engine, "model": self.model,
            "replicas": self.replicas, **asdict(self.latest),
            "requests_per_s": round(self.requests_per_s, 3),
            "failed_per_s": round(self.points[-1].failed_per_s, 3),
            "elapsed": round(self.clock() - self.started, 3), "line": self.line(),
            "panel": {"title": layout["title"]["text"], "layout": layout,
                      "traces": [{"name": name, **props}
                                 for name, props in endpoint_traces(self, last).items()]},
        }


def endpoint_traces(history: EndpointHistory,
                    last: int | None = None) -> dict[str, dict[str, Any]]:
    """``{trace name: plotly trace properties, "type" included}``; empty before the first
    sample. ``last`` keeps only the last points of the series (the pool-state file's bound)."""
    if history.latest is None:
        return {}
    points = history.points[-last:] if last else history.points
    t = [round(p.t, 3) for p in points]

    def line(key: str, axes: tuple[str, str], what: str, **style: Any) -> dict[str, Any]:
        return {"type": "scatter", "mode": "lines", "x": t,
                "y": [round(getattr(p, key), 3) for p in points], "xaxis": axes[0],
                "yaxis": axes[1], "hovertemplate": f"{what}<extra></extra>", **style}

    return {
        f"{PREFIX}requests/s": line("requests_per_s", ("x", "y"),
                                    "%{y:,.2f} requests/s", line={"color": NEUTRAL_TEXT}),
        f"{PREFIX}failed requests/s": line(
            "failed_per_s", ("x", "y"), "%{y:,.2f} failed requests/s (4xx, 5xx, 499)",
            line={"color": "#d62728", "dash": "dot"}),
        f"{PREFIX}in flight": line("in_flight", ("x2", "y2"), "%{y} requests in flight",
                                   line={"color": "#4c78a8", "shape": "hv"}),
        f"{PREFIX}KV blocks used (%)": line(
            "kv_percent", ("x2", "y3"), "%{y:.0f}% of the KV blocks in use (all replicas)",
            line={"color": "#54a24b", "dash": "dash"}),
    }


def endpoint_title(history: EndpointHistory, sample: EndpointSample | None = None) -> str:
    """The panel's title, on two lines (a notebook's figure is about 700 pixels wide), of
    the latest sample or ``sample``."""
    s = sample or history.latest
    head = f"{history.engine} at {history.url}"
    if s is None:
        return f"endpoint {head} (not sampled yet)"
    # the engines report their KV blocks once they have stepped
    kv = (f"KV blocks {s.kv_used:,} of {s.kv_total:,} ({100 * s.kv_used / s.kv_total:.0f}%)"
          if s.kv_total else "KV blocks not reported yet")
    replicas = f"{history.replicas} replica{'s' if history.replicas != 1 else ''}"
    title = (f"endpoint {head}: {s.status}, {history.requests_per_s:,.1f} requests/s, "
             f"{s.in_flight} in flight<br>engines ({replicas}): {s.running} running, "
             f"{s.waiting} waiting, {kv} · {s.requests:,.0f} requests, {s.failed:,.0f} failed")
    return title + (f"<br>unavailable: {s.failure}" if s.failure else "")


def endpoint_layout(history: EndpointHistory) -> dict[str, Any]:
    """Title and the two plots' axes: requests/s on x/y (left), in flight on x2/y2 and KV
    use on y3 (right, overlaying y2). No size, margins or legend: each page sets its own."""
    time_axis = {"text": "s since serving started"}
    return {
        "title": {"text": endpoint_title(history), "font": {"size": 13}},
        "xaxis": {"domain": [0.0, 0.4], "anchor": "y", "title": time_axis},
        "yaxis": {"anchor": "x", "rangemode": "tozero", "title": {"text": "requests/s"}},
        "xaxis2": {"domain": [0.55, 0.92], "anchor": "y2", "title": time_axis},
        "yaxis2": {"anchor": "x2", "rangemode": "tozero",
                   "title": {"text": "requests in flight"}},
        "yaxis3": {"anchor": "x2", "overlaying": "y2", "side": "right", "showgrid": False,
                   "range": [0, 100], "title": {"text": "KV blocks used (%)"}},
    }
