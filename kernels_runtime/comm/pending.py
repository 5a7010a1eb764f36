"""A collective in flight, and how this rank waits for it.

Two ways to wait, chosen by the group's backend (``GroupInfo.queued``):

- host backends (gloo): the op runs on the host, so ``wait`` blocks at most the timeout and a
  failed wait becomes a ``CollectiveTimeoutError`` naming the op and the group. Timing is the
  wall clock.
- device backends (nccl): ``work.wait()`` without a timeout only makes the current stream wait
  for the op; the host goes on queueing work. A timed wait would block the host thread until
  the op completes and run it in lockstep with the GPU, so there is none: the process group's
  own timeout and watchdog bound a hung op. Timing uses device events recorded at issue, at
  the wait and after it, read later without synchronizing (``CommStats.record_later``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kernels_runtime.comm.accelerator import timing_event
from kernels_runtime.comm.groups import GroupInfo
from kernels_runtime.comm.stats import CommStats


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer skipped it, died or is stuck."""

    def __init__(self, op: str, group: str, timeout_s: float, cause: str = "") -> None:
        self.op, self.group, self.timeout_s, self.cause = op, group, timeout_s, cause
        super().__init__(
            f"{op} on process group '{group}' did not complete within {timeout_s:.1f} s: a peer "
            "rank skipped it, died or is stuck. The process group is now unusable; re-create it "
            f"(the pool does this before the next cell). Original error: {cause}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, float, str]]:
        """Keep it picklable with its fields: engines ship exceptions back to the client."""
        return type(self), (self.op, self.group, self.timeout_s, self.cause)


def _seconds_between(first: Any, last: Any) -> float:
    return first.elapsed_time(last) / 1e3  # device events report milliseconds


class PendingOp:
    """A collective in flight; ``wait`` records it in ``stats`` (see the module docstring)."""

    def __init__(self, stats: CommStats, op: str, info: GroupInfo, nbytes: int,
                 timeout_s: float, work: dist.Work | None, start: float, start_event: Any,
                 blocking: bool = False) -> None:
        self.stats, self.op, self.info, self.nbytes = stats, op, info, nbytes
        self.timeout_s, self.work, self.start = timeout_s, work, start
        self.start_event = start_event  # device event recorded before the issue, or None
        self.blocking = blocking  # a synchronous call: the caller was blocked since `start`

    @property
    def group(self) -> str:
        return self.info.name

    def wait(self) -> None:
        if self.work is None:  # not a member of the group, or waited already: nothing to do
            return
        if self.start_event is not None:
            self._order_stream()
        else:
            self._wait_bounded()

    def _wait_bounded(self) -> None:
        entered = self.start if self.blocking else time.perf_counter()
        try:
            self.work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            self.work = None  # a pending gloo work pins the group and its store's port
            raise CollectiveTimeoutError(self.op, self.group, self.timeout_s, str(err)) from err
        self.work = None
        done = time.perf_counter()
        self.stats.record(self.op, self.group, self.nbytes, done - self.start, done - entered)

    def _order_stream(self) -> None:
        start = self.start_event
        entered = start if self.blocking else _recorded(self.info)
        self.work.wait()  # the current stream waits for the op; the host does not
        self.work = None
        done = _recorded(self.info)

        def resolve() -> tuple[float, float] | None:
            if not done.query():
                return None
            return _seconds_between(start, done), _seconds_between(entered, done)

        self.stats.record_later(self.op, self.group, self.nbytes, resolve)


def _recorded(info: GroupInfo) -> Any:
    event = timing_event(info.backend)
    event.record()
    return event


def issue_event(info: GroupInfo) -> Any:
    """The event a device-queued op is timed from (None on host backends)."""
    return _recorded(info) if info.queued else None
