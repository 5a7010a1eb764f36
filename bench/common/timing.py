"""Timing built step functions round by round, the order rotating between rounds.

Interleaving the variants (instead of timing one after the other) spreads the noise of a shared
machine over all of them, so their ratio stays meaningful when the medians move.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def time_variants(made: dict[str, Any], rounds: int, steps: int) -> dict:
    """Per built variant (an object with ``step(i) -> loss``): its first step's loss and, per
    round, the median time of ``steps`` steps. A variant given as a string (the reason it
    could not be built) is passed through under ``skipped``.

    Shared by the tensor-parallel, grid and pipeline benchmarks, so that each times its
    variants the same way."""
    steps_of = {name: v.step for name, v in made.items() if not isinstance(v, str)}
    first = {name: step(0) for name, step in steps_of.items()}
    for step in steps_of.values():
        step(1)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    order = list(steps_of)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            per_step = []
            for i in range(steps):
                t0 = time.perf_counter()
                steps_of[name](2 + r * steps + i)
                per_step.append(time.perf_counter() - t0)
            times[name].append(statistics.median(per_step))
    return {"first_loss": first, "times": times,
            "skipped": {name: v for name, v in made.items() if isinstance(v, str)}}
