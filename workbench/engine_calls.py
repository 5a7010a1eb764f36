"""Small functions the pool sends to its engines.

They are marked ``@interactive`` so that, on the engine, their globals are the engine's user
namespace: that is how ``rank``, ``world_size``, ``comm`` and ``session`` become plain names in
every ``%%colossal`` cell. All real work is delegated to ``kernels_runtime.session``.
"""

from __future__ import annotations

from typing import Any

from ipyparallel import interactive


@interactive
def rank_address(local: bool) -> tuple[str, int]:
    from kernels_runtime.session import rendezvous_address

    return rendezvous_address(local)


@interactive
def start_rank(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None,
    timeout_s: float,
    local_rank: int,
    local_world_size: int,
) -> dict[str, Any]:
    from kernels_runtime.session import RankSession

    old = globals().get("session")
    if old is not None:
        old.close()
    session = RankSession.start(
        rank, world_size, master_addr, master_port, backend, timeout_s, local_rank,
        local_world_size,
    )
    globals().update(
        session=session, rank=rank, world_size=world_size, comm=session.comm, plan=None
    )
    return session.describe()


@interactive
def recreate_group(master_port: int) -> None:
    globals()["session"].recreate_group(master_port)


@interactive
def describe_rank() -> dict[str, Any]:
    return globals()["session"].describe()


@interactive
def set_plan(plan: Any) -> None:
    globals()["plan"] = plan
    globals()["session"].plan = plan


@interactive
def pull_names(names: list[str]) -> dict[str, Any]:
    ns = globals()
    missing = [n for n in names if n not in ns]
    if missing:
        raise NameError(f"--pull: not defined on this rank: {', '.join(missing)}")
    return {n: ns[n] for n in names}


@interactive
def close_rank() -> None:
    session = globals().get("session")
    if session is not None:
        session.close()
