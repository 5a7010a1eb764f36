"""The rank grid as plain integers: coordinates, groups, tp sub-grids, pipeline neighbours.

What is protected: tp is the innermost axis (tensor-parallel peers are adjacent ranks), every
family of groups partitions the ranks, and the 2D/2.5D grids are SUMMA's rows and columns (and
Tesseract's depth), checked on grids larger than any test pool.
"""

from __future__ import annotations

import itertools

import pytest

from kernels_runtime.mesh.plan import AXES
from kernels_runtime.mesh.topology import Topology


def _partitions(groups: list[tuple[int, ...]], world: int) -> bool:
    flat = sorted(r for g in groups for r in g)
    return flat == list(range(world))


@pytest.mark.parametrize("sizes", [(2, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2), (3, 1, 2, 2)])
def test_coordinates_round_trip_with_tp_innermost(sizes):
    topo = Topology(*sizes)
    for rank in range(topo.world):
        assert topo.rank_at(topo.coords(rank)) == rank
    if topo.tp > 1:
        assert topo.coords(1)["tp"] == 1 and topo.coords(1)["dp"] == 0


def test_groups_along_each_axis_partition_the_ranks():
    topo = Topology(dp=2, pp=2, sp=1, tp=2)
    assert topo.groups_along(("tp",)) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert topo.groups_along(("pp",)) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert topo.groups_along(("dp",)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for r in range(1, len(AXES) + 1):
        for axes in itertools.combinations(AXES, r):
            assert _partitions(topo.groups_along(axes), topo.world), axes
    assert Topology(dp=2, sp=2).groups_along(("dp", "sp")) == [(0, 1, 2, 3)]


def test_2d_grid_rows_and_columns():
    topo = Topology(dp=2, tp=4, tp_mode="2d")
    grids = topo.tp_grid_groups()
    assert sorted(grids) == ["tp_col", "tp_row"]
    assert grids["tp_row"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert grids["tp_col"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert topo.tp_grid_coords(3) == {"depth": 0, "row": 1, "col": 1}


def test_2p5d_grid_rows_columns_and_depth():
    topo = Topology(dp=1, tp=8, tp_mode="2.5d", tp_depth=2)  # d = 2 stacked 2 x 2 grids
    grids = topo.tp_grid_groups()
    assert grids["tp_row"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert grids["tp_col"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert grids["tp_dep"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for groups in grids.values():
        assert _partitions(groups, 8)
    assert Topology(dp=2, tp=4).tp_grid_groups() == {}


def test_pipeline_neighbours_and_embedding_pairs():
    topo = Topology(dp=1, pp=4, tp=2)
    assert topo.pp_neighbours(0) == (None, 2)
    assert topo.pp_neighbours(3) == (1, 5)
    assert topo.pp_neighbours(7) == (5, None)
    assert topo.embedding_groups() == [(0, 6), (1, 7)]
    assert Topology(dp=2).embedding_groups() == []
