"""Turning a set of engines into one torch.distributed world: who they are, which rank each
becomes, where rank 0 listens, and the process group on every rank (and again after a failed
cell).

Why apart from ``pool.py``: the pool's lifecycle is about processes (a cluster, engine sets,
a reaper, a Slurm job); this is about ranks, the same whether the engines were just started or
replace dead ones. Every function takes the ipyparallel client and the engine ids it works on
and returns what it learned; the pool keeps it in its ``RankQueries``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ipyparallel as ipp

from kernels_runtime.memory.spill import POOL_ENV
from workbench.errors import PoolError
from workbench.pool import rank_calls
from workbench.pool.ranks import RankLayout, assign_ranks, check_versions, notebook_versions


async def _each(client: ipp.Client, engine_ids: list[int], fn: Any, *args: Any) -> list[Any]:
    """``fn(*args)`` on every engine, results in the order of ``engine_ids``."""
    return list(await asyncio.gather(*(asyncio.wrap_future(client[e].apply_async(fn, *args))
                                       for e in engine_ids)))


async def lay_out(client: ipp.Client, ids: list[int],
                  pool_id: str) -> tuple[RankLayout, list[int], list[int]]:
    """Identify new engines, refuse mismatched versions, tell each its pool (its spill folder
    carries the pool's id) and order them into ranks grouped by host.

    Returns the layout, the engine id of each rank, and the MPI rank of each rank (empty
    unless every engine was started by mpiexec)."""
    idents = await _each(client, ids, rank_calls.identify)
    check_versions(idents, notebook_versions())
    await _each(client, ids, rank_calls.set_environment, {POOL_ENV: pool_id})
    layout = assign_ranks(idents, ids)
    engine_ids = [ids[i] for i in layout.order]
    mpi_ranks = [idents[i]["launcher_rank"] for i in layout.order
                 if idents[i]["launcher"] == "mpi"]
    return layout, engine_ids, mpi_ranks


async def _rendezvous(client: ipp.Client, engine_ids: list[int], hosts: list[str],
                      mpi_ranks: list[int]) -> tuple[str, int]:
    """Rank 0's address and a free port: loopback when every rank is on one host. An MPI
    pool takes it from MPI: every engine joins a broadcast from rank 0's MPI rank."""
    local = len(set(hosts)) <= 1
    if mpi_ranks and len(mpi_ranks) == len(engine_ids):
        answers = await _each(client, engine_ids, rank_calls.mpi_rank_address, mpi_ranks[0],
                              local)
        return tuple(answers[0])  # type: ignore[return-value]
    return tuple(await asyncio.wrap_future(  # type: ignore[return-value]
        client[engine_ids[0]].apply_async(rank_calls.rank_address, local)))


async def init_group(client: ipp.Client, engine_ids: list[int], layout: RankLayout,
                     mpi_ranks: list[int], backend: str | None, collective_timeout_s: float,
                     start_timeout_s: float) -> list[dict[str, Any]]:
    """Create the process group on every rank (rank r on ``engine_ids[r]``); returns each
    rank's description (host, pid, device, backend, memory)."""
    n = len(engine_ids)
    addr, port = await _rendezvous(client, engine_ids, layout.hosts, mpi_ranks)
    futures = [
        client[eid].apply_async(
            rank_calls.start_rank, r, n, addr, port, backend, collective_timeout_s,
            layout.local_ranks[r], layout.local_sizes[r],
        )
        for r, eid in enumerate(engine_ids)
    ]
    try:
        return list(await asyncio.wait_for(
            asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), timeout=start_timeout_s))
    except Exception as e:
        raise PoolError(f"initialising torch.distributed on {n} ranks failed: {e}") from e


async def recreate_group(client: ipp.Client, engine_ids: list[int], hosts: list[str],
                         timeout_s: float) -> None:
    """Re-create the process group on every rank (after an interrupt, timeout or error), on a
    fresh port from rank 0."""
    _, port = await asyncio.wrap_future(
        client[engine_ids[0]].apply_async(rank_calls.rank_address, len(set(hosts)) <= 1))
    await asyncio.wait_for(_each(client, engine_ids, rank_calls.recreate_group, port),
                           timeout=timeout_s)
