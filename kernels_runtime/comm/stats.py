"""Counters of what the collectives did, per operation and per named process group.

The counters are cumulative on purpose: the telemetry publisher keeps only the latest value per
key, so a reading that is lost or arrives twice costs nothing, and rates are differences.
"""

from __future__ import annotations

import threading
from collections import defaultdict

_FIELDS = ("calls", "bytes", "seconds")


class CommStats:
    """Cumulative per-(op, group) counters: calls, bytes, seconds. Thread-safe.

    Cumulative on purpose: the telemetry publisher keeps only the latest value per key.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])

    def record(self, op: str, group: str, nbytes: int, seconds: float) -> None:
        """Add one completed call of `op` on `group` that moved `nbytes` in `seconds`."""
        with self._lock:
            counter = self._counters[(op, group)]
            counter[0] += 1
            counter[1] += nbytes
            counter[2] += seconds

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """A copy shaped {op: {group: {"calls", "bytes", "seconds"}}}, safe to publish."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        with self._lock:
            for (op, group), counter in self._counters.items():
                out.setdefault(op, {})[group] = dict(zip(_FIELDS, counter))
        return out

    def totals(self) -> dict[str, float]:
        """Calls, bytes and seconds summed over every op and group."""
        with self._lock:
            sums = [sum(counter[i] for counter in self._counters.values()) for i in range(3)]
        return dict(zip(_FIELDS, sums))

    def reset(self) -> None:
        """Forget everything, e.g. when the process groups are re-created."""
        with self._lock:
            self._counters.clear()
