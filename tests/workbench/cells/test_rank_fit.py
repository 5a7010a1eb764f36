"""``workbench.fit_ranks``: the notebooks' pool size from the memory the reader has."""

from __future__ import annotations

import pytest

from workbench import fit_ranks
from workbench.cells.rank_fit import GIB, memory_limit


def test_the_largest_choice_that_fits_else_the_smallest(monkeypatch):
    monkeypatch.delenv("WORKBENCH_RANKS", raising=False)
    assert fit_ranks(8, 4, 2, memory=2 * GIB).ranks == 2  # Binder: the kernel + 2 ranks
    fit = fit_ranks(8, 4, 2, memory=3 * GIB)
    assert fit.ranks == 4 and str(fit) == "4 ranks (3.0 GiB of memory)"
    assert fit.need_gib(8) == 5.0
    assert fit_ranks(8, 4, 2, memory=64 * GIB).ranks == 8
    assert fit_ranks(2, 1, memory=1 * GIB).ranks == 1
    assert str(fit_ranks(2, 1, memory=1 * GIB)) == "1 rank (1.0 GiB of memory)"
    real = fit_ranks(2, 1, memory=2 * GIB, rank_gib=1.2, base_gib=0.6)  # a real model a rank
    assert real.ranks == 1 and real.need_gib(2) == pytest.approx(3.0)
    assert memory_limit() > 0 and fit_ranks(2, 1).memory == memory_limit()


def test_workbench_ranks_wins_and_bad_input_says_what_to_write(monkeypatch):
    monkeypatch.setenv("WORKBENCH_RANKS", "4")
    assert str(fit_ranks(2, 1, memory=GIB)) == "4 ranks (WORKBENCH_RANKS=4)"
    monkeypatch.setenv("WORKBENCH_RANKS", "four")
    with pytest.raises(ValueError, match="WORKBENCH_RANKS='four': set it to a rank count"):
        fit_ranks(2)
    with pytest.raises(ValueError, match="fit_ranks takes rank counts"):
        fit_ranks()
