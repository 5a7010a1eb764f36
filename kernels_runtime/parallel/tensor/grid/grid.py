"""This rank's place on a 2D (SUMMA) or 2.5D (Tesseract) tensor-parallel grid.

The tp ranks form ``d`` stacked ``q x q`` grids; tp index ``t = k*q*q + i*q + j`` is depth
``k``, row ``i``, column ``j`` (``mesh/topology.py``). Three groups connect them: ``tp_row``
(same k, i: the ranks that split one batch block's hidden features), ``tp_col`` (same k, j: the
ranks that split one weight column's rows) and, under 2.5D, ``tp_dep`` (same i, j: the
replicas of one weight block, each working on other batch chunks). 2D is the case d = 1.

Every kernel of ``grid/`` takes a ``Grid``: the groups with the global ranks their collectives
name (a broadcast's source, a p2p peer) worked out once, from the topology alone, so no kernel
asks a group anything at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from kernels_runtime.comm import Collectives
from kernels_runtime.comm.groups import Group
from kernels_runtime.mesh.context import ParallelContext


@dataclass(frozen=True)
class Grid:
    """Depth ``k`` < ``depth``, row ``i`` and column ``j`` < ``side`` of this rank."""

    comm: Collectives
    depth: int  # d (1 under 2D)
    side: int  # q
    k: int
    i: int
    j: int
    row: Group  # tp_row: same (k, i), group rank j
    col: Group  # tp_col: same (k, j), group rank i
    dep: Group | None  # tp_dep: same (i, j), group rank k; None under 2D
    tp: Group  # the whole tp group, group rank t
    row_ranks: tuple[int, ...]  # global rank of column l of this row
    col_ranks: tuple[int, ...]  # global rank of row l of this column
    mirror: int  # global rank of (k, j, i): the transposed position

    @classmethod
    def of(cls, ctx: ParallelContext) -> Grid:
        """The grid of ``ctx`` (a plan with tp_mode 2d or 2.5d) on this rank."""
        topology = ctx.topology
        shape = topology.tp_grid_shape if topology is not None else None
        if shape is None:
            raise ValueError(f"plan {ctx.plan.to_string()!r} has no tp grid: use tp_mode=2d "
                             "or 2.5d")
        depth, side = shape
        place = topology.tp_grid_coords(ctx.rank)
        k, i, j = place["depth"], place["row"], place["col"]

        def at(k_: int, i_: int, j_: int) -> int:
            return topology.rank_at({**ctx.coords, "tp": k_ * side * side + i_ * side + j_})

        grid = cls(ctx.comm, depth, side, k, i, j, ctx.group("tp_row"), ctx.group("tp_col"),
                   ctx.group("tp_dep") if depth > 1 else None, ctx.group("tp"),
                   tuple(at(k, i, step) for step in range(side)),
                   tuple(at(k, step, j) for step in range(side)), at(k, j, i))
        grid._check_group_order()
        return grid

    def _check_group_order(self) -> None:
        """The collectives rely on group ranks following the grid coordinates."""
        found = (dist.get_rank(self.row), dist.get_rank(self.col),
                 dist.get_rank(self.dep) if self.dep is not None else 0)
        if found != (self.j, self.i, self.k):
            raise RuntimeError(f"grid groups out of order: group ranks {found} on (k, i, j) = "
                               f"{(self.k, self.i, self.j)}")

    @property
    def batch_chunks(self) -> int:
        """The batch is split into d*q chunks, one per (depth, row)."""
        return self.depth * self.side

    @property
    def batch_chunk(self) -> int:
        """This rank's batch chunk: k*q + i."""
        return self.k * self.side + self.i

    def describe(self) -> str:
        return f"grid (k, i, j) = ({self.k}, {self.i}, {self.j}) of d={self.depth}, q={self.side}"
