"""The live dashboard of a serving endpoint, in the notebook and in the lab.

While ``%colossal serve`` serves, no cell runs (the ranks serve in a background task, uvicorn
answers in a thread), so no cell's waiting loop feeds a dashboard: this thread does. Every
``interval_s`` it takes the ranks' latest telemetry as the server's watcher left it
(``Server.telemetry``, the serving task's datapub data, read every 0.2 s) and the server's own
counts (``Server.metrics``: requests by status, in flight, the engines' queue and KV blocks,
the numbers ``/metrics`` serves), and

- feeds a ``RunHistory`` (memory, communication, tokens/s and the inference panel) and an
  ``EndpointHistory`` (the endpoint panel), and updates the figures it displayed under the
  ``%colossal serve`` cell. plotly's ``FigureWidget`` updates are comm messages, which reach
  the browser from a thread after the cell that displayed them has finished (checked in a real
  JupyterLab by ``tests/playground/test_browser_panels.py``); a headless run keeps the text
  line of the moment it was displayed;
- writes the pool-state file's ``endpoint`` block and the serving ranks' telemetry as its
  running cell (``PoolStateFile.serving_data``, rate-limited there), which the lab's sidebar
  and dashboard page read.

A thread of its own, not the watcher's: drawing costs tens of milliseconds on a busy machine,
and the watcher is what turns a dead rank into 503s, so it must not wait on plotly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from workbench.ui.dashboard.endpoint import EndpointHistory, EndpointSample
from workbench.ui.dashboard.history import RunHistory

log = logging.getLogger("workbench.serving.display")


def gauge(metric: Any) -> float:
    """A prometheus gauge's value now (a gauge with ``set_function`` calls it)."""
    return metric.collect()[0].samples[0].value


def sample_of(server: Any) -> EndpointSample:
    """The server's counts now: requests by status, in flight, the engines' queue and KV."""
    requests = failed = 0.0
    for family in server.metrics.requests.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                requests += s.value
                failed += s.value if int(s.labels.get("status", 200)) >= 400 else 0.0
    m = server.metrics
    if not server.running:
        status = "stopped"
    elif server.failure:
        status = "failed"
    elif not server.accepting:
        status = "stopping"
    else:
        status = "serving"
    return EndpointSample(requests, failed, int(gauge(m.in_flight)), int(gauge(m.running)),
                          int(gauge(m.waiting)), int(gauge(m.kv_used)), int(gauge(m.kv_total)),
                          status, server.failure if status == "failed" else None)


class ServingDisplay:
    """Keeps an endpoint's dashboard (``show``) and its pool's state file current."""

    def __init__(self, server: Any, *, show: bool = True, interval_s: float = 0.5,
                 display: Callable[[Any], None] | None = None) -> None:
        self.server, self.interval_s = server, interval_s
        label = f"serving {server.engine} at {server.url}"
        self.history = RunHistory(list(range(server.pool.world_size)), label=label)
        self.endpoint = EndpointHistory(server.url, server.engine, model=server.model_id,
                                        replicas=server.replicas)
        self.view: Any = None
        self.show, self._display = show, display
        self.ticks = 0  # samples taken
        self.error: str | None = None  # the last failure of a tick, if any
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ServingDisplay:
        """Take a first sample, display the dashboard (``show``) and start following."""
        self.tick()
        if self.show:
            from workbench.ui.dashboard.view import Dashboard

            show = self._display
            if show is None:
                from IPython.display import display as show
            try:
                self.view = Dashboard(self.history, endpoint=self.endpoint)
                show(self.view)
            except Exception as err:  # noqa: BLE001 - serve on without the figures
                log.warning("serving dashboard: cannot display it: %r", err)
                self.view = None
        self._thread = threading.Thread(target=self._follow, name="workbench-serving-display",
                                        daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self, final: bool = False) -> None:
        """One sample: the ranks' telemetry and the server's counts into the histories, the
        figures and the state file. Never raises: the endpoint must not depend on drawing."""
        try:
            changed = self.history.ingest(dict(self.server.telemetry))
            if final:
                self.history.finish()
            self.endpoint.sample(sample_of(self.server))
            self.ticks += 1
            if self.view is not None:
                self.view.refresh(endpoint_only=not changed)
            self.server.pool.state.serving_data(self.history, self.endpoint, final=final)
        except Exception as err:  # noqa: BLE001 - logged once per kind, kept for status
            if self.error != repr(err):
                log.warning("serving dashboard: %r", err)
            self.error = repr(err)

    def close(self) -> None:
        """Serving stopped: a last sample (status "stopped"), and the state file's endpoint
        block goes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.tick(final=True)
