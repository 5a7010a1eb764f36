"""``ParallelContext`` owns every group a strategy communicates in, and builds each once.

What is protected: on 8 real gloo ranks the groups of the context (axes, dp x sp, 2D/2.5D tp
sub-grids, pipeline embedding pairs, neighbours) hold exactly the ranks the topology says;
building contexts again, for the same plan or alternating plans of other axis sizes, creates no
new process group; a context built after the default group is re-created refers to live groups
only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from kernels_runtime.comm import find_free_port, init_distributed
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan
from kernels_runtime.mesh.topology import Topology

from helpers.distributed import process_comm

PLANS = ["dp=2 pp=2 tp=2 microbatches=2", "dp=2 sp=2 tp=2 sp_mode=all_to_all",
         "dp=2 tp=4 tp_mode=2d", "tp=8 tp_mode=2.5d tp_depth=2"]


def _groups(rank: int, world: int, plan: str) -> dict:
    ctx = ParallelContext.build(plan, process_comm())
    members = {name: tuple(dist.get_process_group_ranks(g)) for name, g in ctx.groups.items()}
    return {"members": members, "prev": ctx.pp_prev, "next": ctx.pp_next,
            "names": {name: ctx.comm.group_name(g) for name, g in ctx.groups.items()}}


@pytest.mark.full
@pytest.mark.parametrize("plan", PLANS)
def test_every_group_holds_the_ranks_the_topology_says(ranks, plan):
    results = ranks(8).run(_groups, plan)
    topo = Topology.of(Plan.parse(plan).validate(8))
    expected = {axis: topo.groups_along((axis,)) for axis in ("dp", "pp", "sp", "tp")}
    expected["dp_sp"] = topo.groups_along(("dp", "sp"))
    expected.update(topo.tp_grid_groups())
    for rank, got in enumerate(results):
        for name, groups in expected.items():
            if name == "dp_sp" and not (topo.dp > 1 and topo.sp > 1):
                continue  # then it is the dp or sp group itself
            mine = next(g for g in groups if rank in g)
            assert got["members"][name] == mine, (plan, rank, name)
        assert (got["prev"], got["next"]) == topo.pp_neighbours(rank)
        if topo.pp > 1 and topo.coords(rank)["pp"] in (0, topo.pp - 1):
            pair = next(g for g in topo.embedding_groups() if rank in g)
            assert got["members"]["embedding"] == pair
        assert got["names"]["tp"] == "tp" and got["names"]["dp"] == "dp"


def _rebuilds(rank: int, world: int, plans: list[str], rounds: int) -> list[int]:
    """Process-group counts after the first build of every plan, then after each round."""
    comm = process_comm()
    for plan in plans:
        ParallelContext.build(plan, comm)
    counts = [len(c10d._world.pg_map)]
    for _ in range(rounds):
        for plan in plans:
            ParallelContext.build(plan, comm)
        counts.append(len(c10d._world.pg_map))
    return counts


def test_rebuilding_the_same_plan_creates_no_group(ranks):
    counts = ranks(2).run(_rebuilds, ["dp=2 zero=1"], 20)[0]
    assert len(set(counts)) == 1, counts


def test_alternating_plans_of_other_axis_sizes_creates_no_group(ranks):
    plans = ["dp=2", "tp=2", "pp=2 microbatches=2", "sp=2 sp_mode=ring", "dp=2 zero=3 bf16"]
    counts = ranks(2).run(_rebuilds, plans, 5)[0]
    assert len(set(counts)) == 1, counts


def _after_recreation(rank: int, world: int) -> dict:
    """Re-create the default group in place, as the pool does after a failed cell."""
    comm = process_comm()
    before = ParallelContext.build("dp=2", comm)
    old_groups = set(before.groups.values())
    port = [find_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    init_distributed(rank, world, "127.0.0.1", port[0], timeout_s=30.0)
    after = ParallelContext.build("dp=2", comm)
    live = set(c10d._world.pg_map)
    cached = [g for mesh in comm.meshes.meshes() for g in mesh.all_groups()]
    return {"all_live": all(g in live for g in cached),
            "reused_old": bool(old_groups & set(after.groups.values())),
            "works": comm.all_reduce(torch.ones(1), group=after.dp_group).item()}


def test_a_context_after_the_group_is_recreated_refers_to_live_groups(ranks):
    for result in ranks(2).run(_after_recreation):
        assert result == {"all_live": True, "reused_old": False, "works": 2.0}
