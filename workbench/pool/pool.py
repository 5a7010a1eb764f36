"""A pool of long-lived ranks on an ipyparallel cluster.

Why a pool and not a launcher: notebooks need ranks that survive between cells, can be
interrupted, and come back after a crash without restarting the kernel. ipyparallel gives
long-lived, spawned engine processes (no fork-after-CUDA, no re-running the notebook); this
module turns them into ranks of one torch.distributed world:

- one engine per GPU (``CUDA_VISIBLE_DEVICES`` set per engine), or ``n`` CPU ranks on gloo;
- ranks assigned by the pool, sorted by (host, device, engine id), because ipyparallel's engine
  ids change on every restart;
- the process group created on every rank at start, and re-created after a failed cell.

The pool is the lifecycle of that world: started, reset, restarted and stopped, each step
published. Its parts are objects it holds: the processes themselves (an ipyparallel cluster,
its engine sets, the reaper) are an ``EngineCluster`` (``engines.py``); what it knows about its
ranks (the rank table and the queries on it) is a ``RankQueries`` held as ``pool.ranks``
(``status.py``); forming the torch.distributed world on the engines is ``world.py``.
It publishes its state (ranks, devices, memory, busy/idle) to a ``StatePublisher``
(``state.py``); inside a Jupyter kernel that is the file the JupyterLab extension's
server reads, registered by the ui (``workbench.ui.lab.state``): the pool never imports the ui.

Lifecycle methods are async-first with blocking twins: ``start_async``/``start`` and so on.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp

from workbench._async import LoopThread
from workbench.errors import PoolError
from workbench.pool.engines import EngineCluster
from workbench.pool.launchers import LauncherSpec, resolve_launcher
from workbench.pool.ranks import visible_gpu_count
from workbench.pool.state import StatePublisher, new_publisher, rank_rows
from workbench.pool.status import RankQueries
from workbench.pool.status import RankStatus as RankStatus  # re-exported: workbench.RankStatus
from workbench.pool.world import init_group, lay_out, recreate_group

log = logging.getLogger("workbench.pool.pool")


class Pool:
    """Ranks on ipyparallel engines with torch.distributed initialised on each.

    Parameters
    ----------
    n: number of ranks; default one per visible GPU, or 2 CPU ranks where there is none.
    backend: "nccl" or "gloo"; default nccl on GPU, gloo on CPU.
    launcher: ipyparallel engine launcher: "local" (default), "mpi", "slurm", "ssh", ...
    controller_ip: address the controller binds to. Defaults to 127.0.0.1; remote launchers
        require it explicitly, since binding beyond loopback exposes the controller.
    hosts: for the ssh launcher, engines per host: ``"node1:2,node2:2"`` or a dict.
    launcher_options: Slurm: sbatch options (``["--partition=debug"]``); MPI: mpiexec
        arguments (``["--hostfile", "hosts"]``).
    remote_python: the Python (with torch and the workbench) engines run on other hosts;
        default: this one's path.
    collective_timeout_s: a collective that does not complete within this raises on the rank.
    start_timeout_s: how long start and restart wait for engines (a Slurm job in the queue
        included) and for torch.distributed to initialise.
    publish_state: write the pool-state file for the JupyterLab extension; by default only
        inside a Jupyter kernel (passed to the registered publisher factory).
    state: where the pool publishes its state; default: the registered publisher
        (``workbench.pool.state.publish_pool_state_with``), else nowhere.
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        backend: str | None = None,
        launcher: str = "local",
        controller_ip: str | None = None,
        hosts: str | dict[str, int] | None = None,
        launcher_options: list[str] | tuple[str, ...] = (),
        remote_python: str | None = None,
        collective_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        publish_state: bool | None = None,
        state: StatePublisher | None = None,
        **cluster_kwargs: Any,
    ) -> None:
        if n is not None and n < 1:
            raise PoolError(f"n={n}: a pool needs at least one rank")
        if backend not in (None, "gloo", "nccl"):
            raise PoolError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        self.launcher: LauncherSpec = resolve_launcher(
            launcher, controller_ip, hosts, tuple(launcher_options), remote_python)
        if n is None and self.launcher.hosts:
            n = sum(self.launcher.hosts.values())
        self.requested_n = n
        self.requested_backend = backend
        self.collective_timeout_s = collective_timeout_s
        self.start_timeout_s = start_timeout_s
        self.cluster_kwargs = cluster_kwargs
        self.ranks = RankQueries(self.launcher, publish=lambda busy, dead: self.publish_ranks(
            busy=busy, dead=dead))
        self.gpus = 0
        self.progress = ""  # what a start is waiting for, e.g. a pending Slurm job
        self.needs_reset = False  # set after a failed cell: re-create the group before the next
        self._loop = LoopThread()
        self._engines = EngineCluster(self.launcher, self.ranks, self._note_progress)
        self.state = state if state is not None else new_publisher(publish_state)
        atexit.register(self.state.remove)  # a kernel that exits takes its pool file along

    # ---- the rank table, read from ``self.ranks`` (which owns it) ----------------------
    @property
    def cluster(self) -> ipp.Cluster | None:
        return self.ranks.cluster

    @property
    def client(self) -> ipp.Client | None:
        return self.ranks.client

    @property
    def engine_ids(self) -> list[int]:
        return self.ranks.engine_ids  # index = rank

    @property
    def hosts(self) -> list[str]:
        return self.ranks.hosts  # per rank

    @property
    def started(self) -> bool:
        return self.ranks.started

    # the status queries, answered by ``self.ranks`` (``status.RankQueries``)
    def status(self, timeout_s: float = 5.0) -> list[RankStatus]:
        """Per rank: host, pid, device, backend, memory in use, and idle, busy or dead."""
        return self.ranks.status(timeout_s)

    def dead_ranks(self) -> list[int]:
        return self.ranks.dead_ranks()

    def death_reason(self, rank: int, wait_s: float = 2.0) -> str:
        return self.ranks.death_reason(rank, wait_s)

    def host_of(self, rank: int) -> str:
        return self.ranks.host_of(rank)

    def slurm_jobs(self) -> list[str]:
        return self.ranks.slurm_jobs()

    @property
    def world_size(self) -> int:
        return len(self.engine_ids)

    @property
    def backend(self) -> str:
        info = self.ranks.ranks_info
        return info[0]["backend"] if info else (self.requested_backend or "")

    def view(self, ranks: list[int] | None = None) -> ipp.DirectView:
        """A non-blocking DirectView on the given ranks (all by default), in rank order."""
        self._require_started()
        targets = [self.engine_ids[r] for r in (range(self.world_size) if ranks is None else ranks)]
        view = self.client[targets]
        view.block = False
        return view

    def rank_of_engine(self, engine_id: int) -> int:
        return self.engine_ids.index(engine_id)

    # ---- lifecycle: async first -------------------------------------------------------
    async def start_async(self) -> Pool:
        if self.started:
            return self
        t0 = time.perf_counter()
        self.gpus = 0 if self.requested_backend == "gloo" else visible_gpu_count()
        n = self.requested_n or (self.gpus if self.gpus else 2)
        if self.requested_backend == "nccl" and not self.gpus and not self.launcher.remote:
            raise PoolError("backend='nccl' needs GPUs but none is visible; use backend='gloo'")
        self.state.update("starting", error=None, world_size=n, ranks=[],
                          launcher=self.launcher.engines, backend=self.requested_backend or "")
        async with self._publishing():
            try:
                await self._engines.start(n, self.gpus, self.cluster_kwargs)
                await self._bootstrap(n, set())
            except BaseException:
                await self._engines.discard()  # nothing of a failed start is left running
                raise
        log.info("pool of %d ranks started in %.1f s", n, time.perf_counter() - t0)
        return self

    def _note_progress(self, note: str) -> None:
        if note != self.progress:
            self.progress = note
            if note:
                self.state.update("starting", error=note)

    async def _bootstrap(self, n: int, old: set[int]) -> None:
        """Assign ranks to the new engines (grouped by host) and create the process group
        (``world.py``); the rank table is filled before the group forms, as a failed group
        still leaves engines to stop."""
        assert self.client is not None
        ids = await self._engines.wait_for_new_engines(n, old, self.start_timeout_s)
        layout, self.ranks.engine_ids, mpi_ranks = await lay_out(self.client, ids, self.pool_id)
        self.ranks.hosts = layout.hosts
        self.ranks.ranks_info = await init_group(
            self.client, self.engine_ids, layout, mpi_ranks, self.requested_backend,
            self.collective_timeout_s, self.start_timeout_s)

    async def reset_process_group_async(self) -> None:
        """Re-create the process group on every rank (after an interrupt, timeout or error)."""
        self._require_started()
        assert self.client is not None
        await recreate_group(self.client, self.engine_ids, self.hosts,
                             self.collective_timeout_s + self.start_timeout_s)

    async def restart_async(self) -> Pool:
        """Replace every engine with a fresh one and re-create the process group."""
        if self.cluster is None or self.client is None:
            return await self.start_async()
        n = self.world_size or self.requested_n or 2
        old = set(self.client.ids) | set(self.engine_ids)
        self.state.update("restarting", error=None, ranks=[])
        async with self._publishing():
            await self._engines.replace_engines(n)
            await self._bootstrap(n, old)
        self.needs_reset = False
        return self

    @property
    def pool_id(self) -> str:
        """This pool's name among others on the host (its engines' spill folders carry it)."""
        return self._engines.pool_id

    @contextlib.asynccontextmanager
    async def _publishing(self) -> Any:
        """Publish "running" with the ranks after a (re)start, "failed" with the error."""
        try:
            yield
        except BaseException as e:
            self.state.update("failed", error=f"{type(e).__name__}: {e}")
            raise
        self.publish_ranks("running")

    def publish_ranks(self, state: str | None = None, busy: frozenset[int] = frozenset(),
                      dead: frozenset[int] = frozenset()) -> None:
        """Publish every rank's row (a no-op outside a kernel)."""
        rows = rank_rows(self.ranks.ranks_info, self.engine_ids, busy, dead)
        self.state.update(state, ranks=rows, world_size=self.world_size, backend=self.backend)

    async def stop_async(self) -> None:
        if self.cluster is None:
            return
        self.state.update("stopping")
        try:
            await self._engines.stop()
        finally:
            self.state.update("stopped", ranks=[], world_size=0, cell=None)

    # ---- sync twins -------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = None) -> Pool:
        """Start and wait; ``progress`` (called in this thread) receives what the start is
        waiting for whenever that changes, e.g. "Slurm job 12 pending (Resources)"."""
        return self._loop.run(self.start_async(), on_wait=self._progress_reporter(progress))

    def stop(self) -> None:
        self._loop.run(self.stop_async())

    def restart(self, progress: Callable[[str], None] | None = None) -> Pool:
        return self._loop.run(self.restart_async(), on_wait=self._progress_reporter(progress))

    def _progress_reporter(self, progress: Callable[[str], None] | None) -> Callable[[], None]:
        shown = [""]

        def report() -> None:
            if progress is not None and self.progress and self.progress != shown[0]:
                shown[0] = self.progress
                progress(self.progress)
        return report

    def reset_process_group(self) -> None:
        self._loop.run(self.reset_process_group_async())

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- status -----------------------------------------------------------------------
    def _require_started(self) -> None:
        self.ranks.require_started()

    def __repr__(self) -> str:
        if not self.started:
            return "<Pool: stopped>"
        return f"<Pool: {self.world_size} ranks, backend {self.backend}>"

