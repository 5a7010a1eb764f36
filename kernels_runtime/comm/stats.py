"""Counters of what the collectives did, per operation and per named process group.

The counters are cumulative on purpose: the telemetry publisher keeps only the latest value per
key, so a reading that is lost or arrives twice costs nothing, and rates are differences.

``seconds`` runs from issuing an op to seeing it complete (for an overlapped op that includes
the work done meanwhile); ``blocked`` is the part of it this rank spent blocked waiting (inside
``PendingOp.wait``, or the whole call for synchronous collectives). The telemetry's step split
counts ``blocked`` as communication time.
"""

from __future__ import annotations

import threading
from collections import defaultdict

_FIELDS = ("calls", "bytes", "seconds", "blocked")


class CommStats:
    """Cumulative per-(op, group) counters: calls, bytes, seconds, blocked. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], list[float]] = defaultdict(
            lambda: [0, 0, 0.0, 0.0])
        self._blocked = 0.0  # sum of every counter's "blocked", read at every step boundary

    def record(self, op: str, group: str, nbytes: int, seconds: float,
               blocked: float = 0.0) -> None:
        """Add one completed call of `op` on `group` that moved `nbytes` in `seconds`, of
        which this rank was blocked waiting `blocked`."""
        with self._lock:
            counter = self._counters[(op, group)]
            counter[0] += 1
            counter[1] += nbytes
            counter[2] += seconds
            counter[3] += blocked
            self._blocked += blocked

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """A copy shaped {op: {group: {"calls", "bytes", "seconds", "blocked"}}}."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        with self._lock:
            for (op, group), counter in self._counters.items():
                out.setdefault(op, {})[group] = dict(zip(_FIELDS, counter))
        return out

    def totals(self) -> dict[str, float]:
        """Calls, bytes, seconds and blocked seconds summed over every op and group."""
        with self._lock:
            sums = [sum(counter[i] for counter in self._counters.values())
                    for i in range(len(_FIELDS))]
        return dict(zip(_FIELDS, sums))

    def blocked_seconds(self) -> float:
        """Total seconds blocked in collectives so far (cheap: one running sum)."""
        with self._lock:
            return self._blocked

    def reset(self) -> None:
        """Forget everything, e.g. when the process groups are re-created."""
        with self._lock:
            self._counters.clear()
            self._blocked = 0.0
