"""How a benchmark writes the spread of repeated measurements in its table.

One format for every benchmark, so that "median (min-max)" reads the same everywhere; the
benchmarks whose table already shows the median in a column of its own print only the range.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def spread(values: Sequence[float], digits: int = 3) -> str:
    """``"median (min-max)"`` of ``values``, each with ``digits`` decimals."""
    _check(values)
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def span(values: Sequence[float], digits: int = 2) -> str:
    """``"min-max"`` of ``values``, each with ``digits`` decimals (the median shown beside it)."""
    _check(values)
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def _check(values: Sequence[float]) -> None:
    if len(values) == 0:
        raise ValueError("spread of no measurements: run at least one round (e.g. --rounds 1)")
