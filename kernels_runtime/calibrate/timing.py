"""How every calibration benchmark is timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], sync: Callable[[], None], window_s: float, reps: int = 3) -> float:
    """Median seconds per call of ``fn`` over ``reps`` samples after one warm-up call.

    Each sample loops ``fn`` for about ``window_s`` and divides: a rate sustained over several
    scheduler time slices, which is what a long training step sees when other processes share
    the cores (a single short call often runs alone in one slice and looks too fast).
    ``window_s=0`` times single calls, the same number on every rank, as collectives need.
    """
    t0 = time.perf_counter()
    fn()
    sync()
    inner = max(1, min(1000, round(window_s / max(time.perf_counter() - t0, 1e-9))))
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)
