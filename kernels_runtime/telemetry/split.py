"""Where a rank's training-step time goes: compute, communication, waiting.

Definitions (wall-clock seconds on this rank):

- **step time**: from the end of the previous step to the end of this one. Consecutive steps
  tile the training loop without gaps, so data loading between two ``train_step`` calls belongs
  to the step it feeds. After ``pause()`` (the start of every notebook cell, or explicitly before
  an evaluation) the next step starts where it is begun instead.
- **communication**: time this rank spent blocked in the instrumented collectives during the
  step (``CommStats`` "blocked": inside ``PendingOp.wait``, and the whole call for synchronous
  collectives). Time a straggling peer makes us wait inside a collective lands here. Collectives
  that bypass ``Collectives`` (FSDP2's own) are not seen and count as compute.
- **compute**: wall time inside compute regions (``with telemetry.compute():`` -- in
  ``train_step`` each micro-batch's forward and backward and the optimizer step), less the
  communication waited for inside them (ZeRO's reductions finish at the end of backward). On a
  GPU the host only queues work, so a region is timed by device events instead (a
  ``DeviceTimer``), read when the step ends: never a device synchronize per region, which would
  run the host in lockstep with the GPU. Reading them waits at most for the step's last kernel,
  which the step's loss read-back has usually waited for already.
- **waiting**: the rest, step - compute - communication: data loading, ``.item()`` syncs and
  host copies outside regions, Python glue, logging.

So compute + communication + waiting equals the step time by construction. The one exception
is communication blocked in another thread overlapping this one's regions; waiting is then
clamped at 0 and the sum exceeds the step time by that overlap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

Clock = Callable[[], float]


class DeviceTimer(Protocol):
    """Times a region of queued device work: ``stop(start())`` returns a callable that gives
    the region's device seconds once its work has run (waiting for it if needed)."""

    def start(self) -> Any: ...

    def stop(self, token: Any) -> Callable[[], float]: ...


@dataclass(frozen=True)
class StepTiming:
    seconds: float
    compute: float
    comm: float
    waiting: float


class StepSplitter:
    """Measures the open step window; ``blocked()`` is cumulative collective-blocked seconds."""

    def __init__(self, blocked: Clock, clock: Clock = time.perf_counter,
                 device_timer: DeviceTimer | None = None) -> None:
        self.blocked, self.clock, self.device_timer = blocked, clock, device_timer
        self._device_regions: list[Callable[[], float]] = []  # resolvers of the open window
        self._start: float | None = None  # None: paused, no step window open
        self._blocked_at_start = 0.0
        self._compute = 0.0  # net compute seconds in the open window so far
        self._depth = 0  # nesting of compute regions; only the outermost is timed

    @property
    def open(self) -> bool:
        return self._start is not None

    def begin(self) -> None:
        """Open a step window now, unless one is open already (then the step is contiguous)."""
        if self._start is None:
            self._open_at(self.clock())

    def pause(self) -> None:
        """Close the window: the time until the next ``begin`` belongs to no step."""
        self._start = None
        self._device_regions = []

    def end(self) -> StepTiming | None:
        """Close the step at now and open the next one right away; None if none was open."""
        if self._start is None:
            return None
        now = self.clock()
        compute = self._compute + sum(resolve() for resolve in self._device_regions)
        blocked = self.blocked()
        seconds = now - self._start
        comm = blocked - self._blocked_at_start
        if self._device_regions:  # device time holds the stream's stalls on collectives too
            compute = max(0.0, compute - comm)
        self._device_regions = []
        waiting = max(0.0, seconds - compute - comm)
        self._start, self._blocked_at_start, self._compute = now, blocked, 0.0
        return StepTiming(seconds, compute, comm, waiting)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Mark a compute region; nested regions count once."""
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        if self.device_timer is not None:
            token = self.device_timer.start()
            try:
                yield
            finally:
                self._depth -= 1
                if self._start is not None:
                    self._device_regions.append(self.device_timer.stop(token))
            return
        t0, b0 = self.clock(), self.blocked()
        try:
            yield
        finally:
            self._depth -= 1
            t1, b1 = self.clock(), self.blocked()
            if self._start is not None:
                if self._start > t0:  # the window opened inside this region: count from there
                    t0, b0 = self._start, self._blocked_at_start
                self._compute += max(0.0, (t1 - t0) - (b1 - b0))

    def _open_at(self, now: float) -> None:
        self._start, self._blocked_at_start, self._compute = now, self.blocked(), 0.0
        self._device_regions = []
