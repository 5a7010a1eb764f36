"""``%%colossal --noblock``: a cell that keeps running on the ranks while the notebook goes on.

A training cell can run for hours; blocking the notebook for it wastes the reason to use one.
With ``--noblock`` the cell's wait (output forwarding, the live dashboard, failure handling:
``execution.run_cell``) runs on a thread of the kernel and the magic returns a
``BackgroundCell`` at once. The thread starts with a copy of the cell's context, so under
ipykernel its output keeps going to the cell that started it (the output's parent header is a
context variable), not to whichever cell runs now.

Only one cell runs on a pool at a time: a second ``%%colossal`` waits for nothing, it is
refused until the background cell is done (``wait()``) or stopped (``interrupt()``).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any


class BackgroundCell:
    """Handle of a ``--noblock`` cell: ``ready()``, ``wait(timeout)`` (the pulled values, or
    the cell's error raised), ``interrupt()``; ``history`` is its dashboard's data."""

    def __init__(self, label: str, ranks: list[int], history: Any) -> None:
        self.label, self.ranks, self.history = label, ranks, history
        self.stop = threading.Event()  # asks run_cell to interrupt the ranks
        self._values: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, work: Callable[[threading.Event], dict[str, Any]]) -> BackgroundCell:
        """Run ``work(stop)`` (the cell's wait and pulls) on a thread in this context."""
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run, work),
                                        name=f"colossal-noblock {self.label}", daemon=True)
        self._thread.start()
        return self

    def _run(self, work: Callable[[threading.Event], dict[str, Any]]) -> None:
        try:
            self._values = work(self.stop)
        except BaseException as err:  # kept for wait(): raised in the notebook's thread
            self._error = err

    def ready(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the cell ends; return the ``--pull`` values (also in the notebook's
        namespace), or raise what the cell raised (``RankFailureError``, ...)."""
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.label!r} still runs after {timeout} s; wait longer or "
                               "interrupt() it")
        if self._error is not None:
            raise self._error
        return dict(self._values)

    def interrupt(self) -> None:
        """Interrupt every rank of the cell (as the stop button does a blocking cell)."""
        self.stop.set()

    def __repr__(self) -> str:
        state = "done" if self.ready() else "running"
        failed = f", failed: {type(self._error).__name__}" if self._error else ""
        return (f"<%%colossal --noblock on ranks {self.ranks}: {state}{failed}; .wait() "
                ".ready() .interrupt()>")
