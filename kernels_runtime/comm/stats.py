"""Counters of what the collectives did, per operation and per named process group.

The counters are cumulative on purpose: the telemetry publisher keeps only the latest value per
key, so a reading that is lost or arrives twice costs nothing, and rates are differences.

``seconds`` runs from issuing an op to seeing it complete (for an overlapped op that includes
the work done meanwhile); ``blocked`` is the part of it this rank spent blocked waiting (inside
``PendingOp.wait``, or the whole call for synchronous collectives). The telemetry's step split
counts ``blocked`` as communication time.

On a device whose work is queued (a GPU) the host never waits for a collective, so both are
measured with device events and known only once the events have completed: such calls are
``record_later``-ed with a resolver and counted as soon as a read finds them resolved.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

# returns (seconds, blocked) once the device has completed the op, None before
Resolver = Callable[[], "tuple[float, float] | None"]

_FIELDS = ("calls", "bytes", "seconds", "blocked")


class CommStats:
    """Cumulative per-(op, group) counters: calls, bytes, seconds, blocked. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], list[float]] = defaultdict(
            lambda: [0, 0, 0.0, 0.0])
        self._blocked = 0.0  # sum of every counter's "blocked", read at every step boundary
        self._later: list[tuple[str, str, int, Resolver]] = []

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

    def record_later(self, op: str, group: str, nbytes: int, resolve: Resolver) -> None:
        """A completed call whose timing is known only when ``resolve()`` stops returning None
        (device events); it is counted at the first read that finds it resolved."""
        with self._lock:
            self._later.append((op, group, nbytes, resolve))

    def _resolve(self) -> None:
        if not self._later:
            return
        with self._lock:
            later, self._later = self._later, []
        waiting = []
        for op, group, nbytes, resolve in later:
            timing = resolve()
            if timing is None:
                waiting.append((op, group, nbytes, resolve))
            else:
                self.record(op, group, nbytes, *timing)
        if waiting:
            with self._lock:
                self._later[:0] = waiting

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """A copy shaped {op: {group: {"calls", "bytes", "seconds", "blocked"}}}."""
        self._resolve()
        out: dict[str, dict[str, dict[str, float]]] = {}
        with self._lock:
            for (op, group), counter in self._counters.items():
                out.setdefault(op, {})[group] = dict(zip(_FIELDS, counter))
        return out

    def totals(self) -> dict[str, float]:
        """Calls, bytes, seconds and blocked seconds summed over every op and group."""
        self._resolve()
        with self._lock:
            sums = [sum(counter[i] for counter in self._counters.values())
                    for i in range(len(_FIELDS))]
        return dict(zip(_FIELDS, sums))

    def blocked_seconds(self) -> float:
        """Total seconds blocked in collectives so far (cheap: one running sum)."""
        self._resolve()
        with self._lock:
            return self._blocked

    def reset(self) -> None:
        """Forget everything, e.g. when the process groups are re-created."""
        with self._lock:
            self._counters.clear()
            self._blocked = 0.0
            self._later.clear()
