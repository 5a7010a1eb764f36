"""Rate-limited publishing of telemetry snapshots through an injected callable.

In a pool engine the workbench injects ``ipyparallel.datapub.publish_data``, which keeps only
the latest value per key on the client and tags each message with the parent header of the
request the engine is executing. Two rules follow:

- publish at most a few times a second: the notebook polls about 4 times a second, so more
  messages would only be overwritten, and each one is a pickled dict on the IOPub socket;
- publish only from the thread that installed the publisher (the engine's main thread, which
  runs the cells): from another thread the message could be attributed to the wrong request.
  Calls from other threads are skipped; the next call from the main thread carries the figures,
  since they are cumulative.

In a ``torchrun`` script nothing is installed and publishing is a no-op.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Send = Callable[[dict[str, Any]], None]


class Publisher:
    """Calls ``send(payload)`` at most once per ``min_interval_s`` unless forced."""

    def __init__(self, send: Send | None = None, min_interval_s: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.sent = 0
        self.errors = 0
        self.last_error = ""
        self._last = float("-inf")
        self.install(send)

    def install(self, send: Send | None) -> None:
        """Publish through ``send`` from now on, and only from the calling thread."""
        self._send = send
        self._thread = threading.get_ident()

    @property
    def active(self) -> bool:
        return self._send is not None and threading.get_ident() == self._thread

    def due(self) -> bool:
        """Whether a publish now would go out (installed, right thread, interval elapsed)."""
        return self.active and self.clock() - self._last >= self.min_interval_s

    def publish(self, payload: dict[str, Any], force: bool = False) -> bool:
        """Send ``payload`` if due (or ``force``d, still only from the installing thread).

        A failing ``send`` never stops training: the error is counted and kept for display."""
        if not (self.active and (force or self.due())):
            return False
        self._last = self.clock()
        try:
            self._send(payload)  # type: ignore[misc]
        except Exception as err:  # a dashboard problem must not kill a training run
            self.errors += 1
            self.last_error = f"{type(err).__name__}: {err}"
            return False
        self.sent += 1
        return True
