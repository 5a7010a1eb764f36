"""Where a rank's training-step time goes: compute, communication, waiting.

"Waiting" has to mean that the rank really waited (a pipeline bubble, a late peer, its data),
because that is what a user acts on. So waiting and communication are measured, and compute
is the rest: a custom loop that marks nothing shows its time as compute, not as waiting.

Definitions (wall-clock seconds on this rank):

- **step time**: from the end of the previous step to the end of this one. Consecutive steps
  tile the training loop without gaps, so data loading between two ``train_step`` calls belongs
  to the step it feeds. After ``pause()`` (the start of every notebook cell, or explicitly before
  an evaluation) the next step starts where it is begun instead.
- **waiting**: time this rank was blocked on something other than moving its own bytes:

  - *receives* (op ``recv``): a receive blocks until the peer has produced and sent its
    tensor; on a pipeline this is the bubble (the timeline's ``waited_seconds``);
  - *ops that move no bytes* (``barrier``): pure synchronization;
  - *collective waits beyond their transfer*: a collective ends only after its slowest peer
    has joined, and that time is waiting. A collective's transfer time is estimated at the
    best rate (bytes per blocked second, over whole steps) this rank has seen for that op on
    that group: a step at that rate counts all its blocking as communication, a slower one
    the excess as waiting. So a peer that is late in every step sets the rate itself and
    shows as communication, and the first step of a group is all communication;
  - *marked waits*: ``with telemetry.waiting():`` around data loading or any wait the runtime
    cannot see (less the collective blocking inside it, which is classified as above).

- **communication**: the rest of the time blocked in the instrumented collectives (``CommStats``
  "blocked": inside ``PendingOp.wait``, the whole call for synchronous collectives; on a GPU the
  stream's stalls, from device events): the estimated transfer of collectives and sends.
  Collectives that bypass ``Collectives`` are not seen and count as compute.
- **compute**: everything else, step - communication - waiting: forward, backward, the
  optimizer, and also unmarked host work (Python glue, logging) and host syncs such as
  ``.item()`` (on a GPU the host waits there while the device computes). No region needs to be
  marked, and on a GPU nothing is synchronized to measure it.

So compute + communication + waiting equals the step time by construction. The one exception
is time blocked in another thread overlapping this one's; compute is then clamped at 0 and the
sum exceeds the step time by that overlap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

Clock = Callable[[], float]
# (op, group) -> cumulative (bytes, blocked seconds), e.g. from ``CommStats.snapshot()``
Counters = Callable[[], Mapping[tuple[str, str], tuple[float, float]]]
WAIT_OPS = frozenset({"recv", "barrier"})  # their whole blocked time is waiting


@dataclass(frozen=True)
class StepTiming:
    seconds: float
    compute: float
    comm: float
    waiting: float


class StepSplitter:
    """Measures the open step window from the collectives' cumulative ``counters()``."""

    def __init__(self, counters: Counters, clock: Clock = time.perf_counter) -> None:
        self.counters, self.clock = counters, clock
        self.best_rate: dict[tuple[str, str], float] = {}  # bytes per blocked second
        self._start: float | None = None  # None: paused, no step window open
        self._base: Mapping[tuple[str, str], tuple[float, float]] = {}
        self._marked = 0.0  # seconds in wait regions of the open window, net of blocking
        self._depth = 0  # nesting of wait regions; only the outermost is timed

    @property
    def open(self) -> bool:
        return self._start is not None

    def begin(self) -> None:
        """Open a step window now, unless one is open already (then the step is contiguous)."""
        if self._start is None:
            self._open_at(self.clock(), self.counters())

    def pause(self) -> None:
        """Close the window: the time until the next ``begin`` belongs to no step."""
        self._start = None

    def end(self) -> StepTiming | None:
        """Close the step at now and open the next one right away; None if none was open."""
        if self._start is None:
            return None
        now, counters = self.clock(), self.counters()
        comm, waiting = self._classify(counters)
        waiting += self._marked
        seconds = now - self._start
        compute = max(0.0, seconds - comm - waiting)
        self._open_at(now, counters)
        return StepTiming(seconds, compute, comm, waiting)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark a wait the collectives do not see (data loading); nested marks count once."""
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        t0, b0 = self.clock(), _blocked(self.counters())
        try:
            yield
        finally:
            self._depth -= 1
            t1, b1 = self.clock(), _blocked(self.counters())
            if self._start is not None:
                if self._start > t0:  # the window opened inside this region: count from there
                    t0, b0 = self._start, _blocked(self._base)
                self._marked += max(0.0, (t1 - t0) - (b1 - b0))

    def _classify(self, counters: Mapping[tuple[str, str], tuple[float, float]]
                  ) -> tuple[float, float]:
        """(communication, waiting) seconds of the collectives since the window opened."""
        comm = waiting = 0.0
        for key, (nbytes, blocked) in counters.items():
            b0, s0 = self._base.get(key, (0.0, 0.0))
            if nbytes < b0 or blocked < s0:  # the stats were reset (groups re-created)
                b0, s0 = 0.0, 0.0
            moved, spent = nbytes - b0, blocked - s0
            if spent <= 0:
                continue
            if key[0] in WAIT_OPS or moved <= 0:
                waiting += spent
                continue
            best = self.best_rate[key] = max(self.best_rate.get(key, 0.0), moved / spent)
            transfer = min(spent, moved / best)
            comm += transfer
            waiting += spent - transfer
        return comm, waiting

    def _open_at(self, now: float,
                 counters: Mapping[tuple[str, str], tuple[float, float]]) -> None:
        self._start, self._base, self._marked = now, dict(counters), 0.0


def _blocked(counters: Mapping[tuple[str, str], tuple[float, float]]) -> float:
    return sum(blocked for _, blocked in counters.values())
