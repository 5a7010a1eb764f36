"""``%%colossal`` cells that build a ``ParallelContext`` reuse the session's process groups.

What is protected: a notebook rebuilds its context in every rerun of a cell; on a real 2-rank
pool, 20 reruns, and reruns alternating three plans with different axis sizes, leave the
number of process groups on each rank unchanged; after a failed cell (whose process group the
pool re-creates) the session's cached meshes refer only to live groups, and a context built
then works.
"""

from __future__ import annotations

import pytest

from workbench.errors import RankFailureError

pytestmark = pytest.mark.engines

COUNT = ("from torch.distributed import distributed_c10d as _c10d\n"
         "groups = len(_c10d._world.pg_map)\n")
BUILD = "from kernels_runtime import ParallelContext\nctx = ParallelContext.build(plan, comm)\n"


def cell(ip, line, code):
    return ip.run_cell_magic("colossal", line, code)


def _counts(shell, plans: list[str], reruns: int) -> list[int]:
    seen = []
    for _ in range(reruns):
        for plan in plans:
            cell(shell, f'--plan "{plan}" --pull groups', BUILD + COUNT)
            seen.append(shell.user_ns["groups"])
    return seen


def test_rerunning_a_context_cell_twenty_times_adds_no_group(shell):
    counts = _counts(shell, ["dp=2 zero=1"], 20)
    assert len(set(counts)) == 1, counts


def test_alternating_plans_of_other_axis_sizes_adds_no_group(shell):
    plans = ["dp=2", "tp=2", "pp=2 microbatches=2"]
    _counts(shell, plans, 1)  # first build of each plan's groups
    counts = _counts(shell, plans, 4)
    assert len(set(counts)) == 1, counts


def test_after_a_failed_cell_no_cached_mesh_refers_to_a_dead_group(shell):
    cell(shell, '--plan "dp=2"', BUILD + "old = set(ctx.groups.values())")
    with pytest.raises(RankFailureError):  # a collective only rank 0 enters: times out
        cell(shell, "", "import torch\nif rank == 0:\n    comm.all_reduce(torch.ones(1))\n")
    check = ("live = set(_c10d._world.pg_map)\n"
             "cached = [g for m in comm.meshes.meshes() for g in m.all_groups()]\n"
             "before = all(g in live for g in cached)\n" + BUILD +
             "cached = [g for m in comm.meshes.meshes() for g in m.all_groups()]\n"
             "after = all(g in live | set(_c10d._world.pg_map) for g in cached)\n"
             "fresh = not (old & set(ctx.groups.values()))\n"
             "import torch\nt = torch.ones(1)\ncomm.all_reduce(t, group=ctx.dp_group)\n"
             "total = t.item()\n")
    cell(shell, '--plan "dp=2" --pull before,after,fresh,total', COUNT + check)
    ns = shell.user_ns
    assert (ns["before"], ns["after"], ns["fresh"], ns["total"]) == (True, True, True, 2.0)
