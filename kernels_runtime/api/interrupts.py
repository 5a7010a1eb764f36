"""Holding an interrupt until the training step is whole, so every rank stops after the same one.

The notebook's stop button reaches every rank as SIGINT, a moment apart. Raised where it lands,
it would leave some parameters updated and others not, and the ranks would disagree on which
step they stopped at: a pipeline's last stage is already waiting inside the next step while the
first stage still runs the backward of this one. So inside ``held_interrupts()`` (the whole of
``train_step``: its schedule and the optimizer step) a SIGINT is only noted, and raised once the
step is applied. Why that is enough: a rank cannot complete a step its peers have not reached
(every step ends in communication with them), so a rank interrupted between steps has
completed the same steps as a peer holding its interrupt to the end of the step, and a rank
already waiting inside the next step completes nothing more (it waits until the others answer
or its collective times out, which the pool's interrupt handling reports). No extra collective
is needed, so the step's communication is unchanged.

A second SIGINT inside the block raises at once: the way out of a step stuck in a collective.
Only the main thread receives signals; elsewhere the block notes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOPPED = "interrupted; the training step that was running completed, and stopped after it"


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
