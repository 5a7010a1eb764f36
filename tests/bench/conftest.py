"""The benchmarks' runs on real ranks form their own tier, ``make test-bench``.

Every test here marked ``full`` or ``slow`` (a ``--quick`` run, or the rank side of a
benchmark's formulas) is also marked ``bench``: ``make test`` and ``make test-full`` leave those
out and ``make test-bench`` runs them (``.ci/run`` runs all three), so the user-facing tiers
keep their budgets while every benchmark stays in CI. The benchmarks' unit tests (formulas,
tables, no ranks) stay in ``make test-fast``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        ranked = item.get_closest_marker("full") or item.get_closest_marker("slow")
        if ranked and HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.bench)
