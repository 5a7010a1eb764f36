"""Holding an interrupt until the training step is whole, and stopping every rank at the same one.

The notebook's stop button reaches every rank as SIGINT, a moment apart. Raised where it lands,
it would leave some parameters updated and others not, and the ranks would disagree on which
step they stopped at: a pipeline's last stage is already waiting inside the next step while the
first stage still runs the backward of this one. So inside ``held_interrupts()`` a SIGINT is only
noted; at the end of the step every rank says whether it saw one (``stop_requested``, folded into
the step's one host synchronization) and all of them stop after the same step, or none does.

A second SIGINT inside the block raises at once: the way out of a step stuck in a collective.
Only the main thread receives signals; elsewhere the block notes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOPPED = "interrupted; every rank completed the same training step and stopped after it"


@contextlib.contextmanager
def held_interrupts() -> Iterator[list[int]]:
    """Yield the list of SIGINTs seen inside the block (empty if none); see the module doc."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def note(signum: int, frame: object) -> None:
        if caught:  # pressed twice: do not wait for the step
            raise KeyboardInterrupt("interrupted twice; the training step was abandoned midway")
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)
