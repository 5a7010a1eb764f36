"""Holding an interrupt until the optimizer step is whole.

The notebook's stop button reaches every rank as SIGINT. Arriving inside ``optimizer.step()``
it would leave some parameters updated and others not, and ranks that were interrupted a
moment apart would disagree on which step they are at. Inside ``interrupt_after()`` a SIGINT is
noted and raised as ``KeyboardInterrupt`` when the block ends, so a step is applied on a rank
entirely or not at all. Only the main thread receives signals; elsewhere this does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupt_after() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt("interrupted; the optimizer step that was running completed")
