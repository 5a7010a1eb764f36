"""Sync twins for async-first classes.

The pool's lifecycle methods are coroutines (they await ipyparallel's own coroutines). Notebook
users mostly want blocking calls, but a Jupyter kernel already runs an event loop in its main
thread, so ``asyncio.run`` is not allowed there. Each object therefore owns one background
thread with its own loop and runs every coroutine on it; keeping them on one loop matters
because ipyparallel's launchers schedule callbacks on the loop they were started from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one asyncio loop; ``run(coro)`` blocks until it finishes."""

    def __init__(self, name: str = "workbench-loop") -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name=name, daemon=True)
        self._thread.start()
        ready.wait(10)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T],
            on_wait: Callable[[], None] | None = None) -> T:
        """Run ``coro`` on the loop and wait; ``on_wait`` is called in the waiting (calling)
        thread about 4 times a second, so what it prints lands in the caller's cell."""
        future = self.submit(coro)
        try:
            while on_wait is not None:
                try:
                    return future.result(timeout=0.25)
                except concurrent.futures.TimeoutError:
                    on_wait()
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread
