"""Small functions the pool sends to its engines.

They are marked ``@interactive`` so that, on the engine, their globals are the engine's user
namespace: that is how ``rank``, ``world_size``, ``comm`` and ``session`` become plain names in
every ``%%colossal`` cell. All real work is delegated to ``kernels_runtime.session``.

Telemetry reaches the notebook through ipyparallel's datapub: ``start_rank`` installs
``publish_data`` as the session telemetry's publisher (from the engine's main thread, which runs
the cells, so messages carry the running cell's parent header) and two shell hooks: before each
cell the step clock pauses (idle time between cells belongs to no step), after each cell the
telemetry flushes, so the notebook always receives a run's final figures.
"""

from __future__ import annotations

from typing import Any

from ipyparallel import interactive

from kernels_runtime.telemetry import TELEMETRY_KEY


def publish_telemetry(snapshot: dict[str, Any]) -> None:
    """The engine-side publisher: one datapub key holding the whole, consistent snapshot."""
    from ipyparallel.datapub import publish_data

    publish_data({TELEMETRY_KEY: snapshot})


class TelemetryCellHooks:
    """``pre_run_cell``: pause the step clock and export torchrun's variables again;
    ``post_run_cell``: flush the telemetry.

    Looks the session up in the namespace at each call, so it survives ``start_rank`` replacing
    the session; registered once per engine shell."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace

    def pre_run_cell(self, info: Any) -> None:
        session = self.namespace.get("session")
        if session is not None:
            session.telemetry.new_cell()  # pause, and the curves start again at step 1
            session.restore_environment()  # a library may have deleted torchrun's variables

    def post_run_cell(self, result: Any) -> None:
        session = self.namespace.get("session")
        if session is not None:
            session.telemetry.flush()

    @classmethod
    def install(cls, shell: Any, namespace: dict[str, Any]) -> None:
        callbacks = shell.events.callbacks["post_run_cell"]
        if any(isinstance(getattr(cb, "__self__", None), cls) for cb in callbacks):
            return
        hooks = cls(namespace)
        shell.events.register("pre_run_cell", hooks.pre_run_cell)
        shell.events.register("post_run_cell", hooks.post_run_cell)


@interactive
def identify() -> dict[str, Any]:
    """Who this engine is: host, device, pid, the launcher's ranks, torch and workbench
    versions (compared across hosts at start)."""
    import os
    import socket

    import torch

    from kernels_runtime.launcher_env import launcher_rank
    from workbench.version import __version__

    return {
        "host": socket.gethostname(),
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "pid": os.getpid(),
        "torch": str(torch.__version__),  # a plain str: TorchVersion would import torch here
        "workbench": __version__,
        **launcher_rank(),
    }


@interactive
def rank_address(local: bool) -> tuple[str, int]:
    from kernels_runtime.session import rendezvous_address

    return rendezvous_address(local)


@interactive
def mpi_rank_address(root: int, local: bool) -> tuple[str, int]:
    """Called on every engine of an MPI pool at once: MPI rank ``root`` picks the rendezvous
    and MPI broadcasts it."""
    from kernels_runtime.launcher_env import mpi_rendezvous

    return mpi_rendezvous(root, local)


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
    from IPython import get_ipython

    from kernels_runtime.session import RankSession
    from workbench.pool.rank_calls import TelemetryCellHooks, publish_telemetry  # our globals

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
    session.telemetry.set_publisher(publish_telemetry)
    TelemetryCellHooks.install(get_ipython(), globals())
    return session.describe()


@interactive
def set_environment(values: dict[str, str]) -> None:
    """Variables the runtime reads on this engine (its pool's id names its spill folder)."""
    import os

    os.environ.update(values)


@interactive
def recreate_group(master_port: int) -> None:
    globals()["session"].recreate_group(master_port)


@interactive
def describe_rank() -> dict[str, Any]:
    return globals()["session"].describe()


@interactive
def rank_memory() -> dict[str, Any]:
    """What this rank could hold: its device's bytes (None for a CPU rank) and its host's
    available bytes (shared by every rank on that host; a container's cgroup limit counts),
    with the host's name."""
    import socket

    from kernels_runtime.memory.free import host_free

    return {"device": globals()["session"].state.accelerator.total_memory(),
            "host_available": host_free(), "host": socket.gethostname()}


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
