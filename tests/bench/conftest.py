"""The benchmarks' ``--quick`` runs of the full tier form their own tier, ``make test-bench``.

Every test here marked ``full`` is also marked ``bench``: ``make test-full`` leaves those out
and ``make test-bench`` runs them (``.ci/run`` runs both), so the full tier's 8-rank matrix,
daemons and notebooks keep their budget while the benchmarks stay in CI. Benchmark tests of
``make test`` (``slow``) stay there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents and item.get_closest_marker("full"):
            item.add_marker(pytest.mark.bench)
