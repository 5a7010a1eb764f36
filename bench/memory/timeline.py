"""Where a step's time goes, for the disk tier against no offload (printed by ``run.py``).

Why: "the disk-tier step / its bandwidth bound" says how far the step is from the disk's limit,
not what keeps it there. Per step of a variant: forward and backward on the compute thread (the
disk tier's deferred chunk steps run inside the forward, so they are shown apart, with the
optimizer's arithmetic among them), the time that thread waited on disk reads and writes, the
disk threads' busy time (reads and writes overlap each other and the compute), and the compute
thread's CPU time split into user and kernel (``RUSAGE_THREAD``: kernel time there is page
faults and unmapping on a host-only machine, not I/O, which the disk threads do), and the time
it was ready to run but waited for a CPU (``/proc/thread-self/schedstat``: on a machine others
load, how much of the step is theirs).
"""

from __future__ import annotations

import resource
import statistics
import time

from bench.common.table import print_table

PARTS = ["forward s", "of it: chunk steps s", "backward s", "waited on disk s",
         "disk reading s", "disk writing s", "CPU user s", "CPU kernel s", "waited for a CPU s"]


class StepClock:
    """The marks of one step: ``loss_fn`` wraps the loss (its end is the forward's), ``stop``
    at the optimizer step's start ends the backward; ``figures`` reads the runtime's
    counters around it."""

    def __init__(self, opt, loss_fn) -> None:  # noqa: ANN001 - a boosted optimizer, a loss
        self.sync = getattr(opt, "sync", None)
        self._loss_fn = loss_fn
        self.marks: dict[str, float] = {}
        self._before = self._counters()

    def loss_fn(self, model, batch):  # noqa: ANN001, ANN201 - as train_step calls it
        self.marks["start"] = time.perf_counter()
        loss = self._loss_fn(model, batch)
        self.marks["forward"] = time.perf_counter()
        return loss

    def stop(self) -> None:
        self.marks["backward"] = time.perf_counter()

    def _counters(self) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        out = {"user": usage.ru_utime, "kernel": usage.ru_stime, "chunk": 0.0,
               "read": 0.0, "write": 0.0, "runnable": _runnable_seconds()}
        deferred = getattr(self.sync, "deferred", None)
        if deferred is not None:
            out["chunk"] = deferred.seconds
        store = getattr(self.sync, "store", None)
        disk = getattr(getattr(store, "traffic", None), "_disk", None)
        if disk is not None:
            out["read"], out["write"] = disk.read_seconds, disk.write_seconds
        return out

    def figures(self) -> dict[str, float]:
        after, before, m = self._counters(), self._before, self.marks
        last = getattr(self.sync, "last_step", None) or {}
        return {"forward s": m["forward"] - m["start"],
                "of it: chunk steps s": after["chunk"] - before["chunk"],
                "backward s": m["backward"] - m["forward"],
                "waited on disk s": last.get("wait_seconds", 0.0),
                "disk reading s": after["read"] - before["read"],
                "disk writing s": after["write"] - before["write"],
                "CPU user s": after["user"] - before["user"],
                "CPU kernel s": after["kernel"] - before["kernel"],
                "waited for a CPU s": after["runnable"] - before["runnable"]}


def _runnable_seconds() -> float:
    """Seconds this thread has waited on a run queue (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def report(timelines: dict[str, list[dict[str, float]]]) -> None:
    """Medians over rounds, one row per part, one column per variant."""
    names = list(timelines)
    print_table(["step part (medians)", *names],
                [[part, *(statistics.median(t[part] for t in timelines[n]) for n in names)]
                 for part in PARTS])
    print("(chunk steps: the disk tier's deferred optimizer steps, inside its forward; disk "
          "reading/writing: busy time of the disk threads, overlapping the compute)")
