"""Which ranks form which group: the dp x pp x sp x tp grid as plain integers.

The whole topology is one row-major grid of global ranks with shape ``(dp, pp, sp, tp)``, tp
innermost so tensor-parallel peers are adjacent ranks (same node, fastest links), dp outermost
(as picotron's ``arange(world).view(dp, pp, cp, tp)``). Every group is a set of ranks that
differ only along some axes; 2D and 2.5D tensor parallelism further arrange the tp ranks as a
``q x q`` grid (SUMMA) or ``d`` stacked ``q x q`` grids (Tesseract).

No torch here: the lists can be checked by tests on any number of ranks without processes,
and ``ParallelContext`` turns them into process groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kernels_runtime.mesh.plan import AXES, Plan

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    dp: int
    pp: int = 1
    sp: int = 1
    tp: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1
    ep: int = 1  # expert-parallel groups inside dp (``expert_groups``); not a mesh axis

    @classmethod
    def of(cls, plan: Plan) -> Topology:
        """The topology of a validated plan (dp resolved)."""
        if plan.dp is None:
            raise ValueError("resolve dp first: Plan.validate(world_size) returns such a plan")
        return cls(plan.dp, plan.pp, plan.sp, plan.tp, plan.tp_mode, plan.tp_depth, plan.ep)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.dp, self.pp, self.sp, self.tp)

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[AXES.index(axis)]

    # ---- coordinates --------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a grid of {self.world} ranks")
        out, rest = {}, rank
        for axis, size in zip(reversed(AXES), reversed(self.sizes)):
            rest, out[axis] = divmod(rest, size)
        return {axis: out[axis] for axis in AXES}

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            rank = rank * size + coords[axis]
        return rank

    # ---- groups -------------------------------------------------------------------------
    def groups_along(self, axes: tuple[str, ...]) -> list[Ranks]:
        """Every group of ranks that differ only along ``axes`` (each group ordered by those
        axes' coordinates, row-major in the order given), in a fixed order."""
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; axes are {AXES}")
        fixed = [a for a in AXES if a not in axes]
        groups = []
        for base in itertools.product(*(range(self.size(a)) for a in fixed)):
            where = dict(zip(fixed, base))
            members = []
            for moving in itertools.product(*(range(self.size(a)) for a in axes)):
                members.append(self.rank_at({**where, **dict(zip(axes, moving))}))
            groups.append(tuple(members))
        return groups

    def group_of(self, rank: int, axes: tuple[str, ...]) -> Ranks:
        return next(g for g in self.groups_along(axes) if rank in g)

    # ---- 2D / 2.5D tensor-parallel grids ------------------------------------------------
    @property
    def tp_grid_shape(self) -> tuple[int, int] | None:
        """(depth d, side q) of the tp grid under 2d/2.5d; None under 1d."""
        if self.tp_mode == "1d":
            return None
        depth = self.tp_depth if self.tp_mode == "2.5d" else 1
        q = math.isqrt(self.tp // depth)
        return depth, q

    def tp_grid_coords(self, rank: int) -> dict[str, int]:
        """(depth k, row i, column j) of this rank's tp index t = k*q*q + i*q + j."""
        shape = self.tp_grid_shape
        if shape is None:
            raise ValueError("tp_grid_coords is for tp_mode=2d or 2.5d")
        _, q = shape
        depth, rest = divmod(self.coords(rank)["tp"], q * q)
        row, col = divmod(rest, q)
        return {"depth": depth, "row": row, "col": col}

    def tp_grid_groups(self) -> dict[str, list[Ranks]]:
        """"tp_row" (same depth and row), "tp_col" (same depth and column) and, under 2.5d,
        "tp_dep" (same row and column across depths), each as lists of global ranks."""
        shape = self.tp_grid_shape
        if shape is None:
            return {}
        depth, q = shape
        kinds = {"tp_row": ("depth", "row"), "tp_col": ("depth", "col")}
        if self.tp_mode == "2.5d":
            kinds["tp_dep"] = ("row", "col")
        out: dict[str, list[Ranks]] = {}
        for name, keep in kinds.items():
            buckets: dict[tuple, list[int]] = {}
            for tp_group in self.groups_along(("tp",)):
                base = tp_group[0]
                for rank in tp_group:
                    c = self.tp_grid_coords(rank)
                    buckets.setdefault((base, *(c[k] for k in keep)), []).append(rank)
            out[name] = [tuple(members) for members in buckets.values()]
        return out

    # ---- expert parallelism -------------------------------------------------------------
    def expert_groups(self) -> dict[str, list[Ranks]]:
        """"ep": every run of ``ep`` adjacent dp coordinates of a dp group (they split the
        experts); "edp": the dp ranks with the same place in their ep group (they hold the
        same experts, so their expert gradients are reduced together). A dp coordinate d sits
        at place d % ep of ep group d // ep, as Megatron's expert-parallel ranks are the inner
        part of its data-parallel ones."""
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp={self.dp}")
        out: dict[str, list[Ranks]] = {"ep": [], "edp": []}
        for dp_group in self.groups_along(("dp",)):
            out["ep"] += [dp_group[i:i + self.ep] for i in range(0, self.dp, self.ep)]
            out["edp"] += [dp_group[i::self.ep] for i in range(self.ep)]
        return out

    # ---- pipeline -----------------------------------------------------------------------
    def pp_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next pipeline stage (None at the ends)."""
        c = self.coords(rank)
        prev = self.rank_at({**c, "pp": c["pp"] - 1}) if c["pp"] > 0 else None
        nxt = self.rank_at({**c, "pp": c["pp"] + 1}) if c["pp"] < self.pp - 1 else None
        return prev, nxt

    def embedding_groups(self) -> list[Ranks]:
        """First and last stage of each pipeline: where tied input/output embeddings live and
        their gradients are summed. Empty without pipeline parallelism."""
        if self.pp == 1:
            return []
        return [(g[0], g[-1]) for g in self.groups_along(("pp",))]
