"""A pool of long-lived ranks on an ipyparallel cluster.

Why a pool and not a launcher: notebooks need ranks that survive between cells, can be
interrupted, and come back after a crash without restarting the kernel. ipyparallel gives
long-lived, spawned engine processes (no fork-after-CUDA, no re-running the notebook); this
module turns them into ranks of one torch.distributed world:

- one engine per GPU (``CUDA_VISIBLE_DEVICES`` set per engine), or ``n`` CPU ranks on gloo;
- ranks assigned by the pool, sorted by (host, device, engine id), because ipyparallel's engine
  ids change on every restart;
- the process group created on every rank at start, and re-created after a failed cell.

The pool is lifecycle: processes started, watched and stopped. What it knows about its ranks
(the rank table and the queries on it) is a ``RankQueries`` it holds as ``pool.ranks``
(``pool_status.py``); forming the torch.distributed world on the engines is ``world.py``.
It publishes its state (ranks, devices, memory, busy/idle) to a ``StatePublisher``
(``pool_state.py``); inside a Jupyter kernel that is the file the JupyterLab extension's
server reads, registered by the ui (``workbench.ui.lab.state``): the pool never imports the ui.

Lifecycle methods are async-first with blocking twins: ``start_async``/``start`` and so on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import ipyparallel as ipp

from workbench._async import LoopThread
from workbench.errors import PoolError
from workbench.pool import rank_calls
from workbench.pool.cleanup import arm_reaper, remove_dead_spill
from workbench.pool.launchers import LauncherSpec, cluster_config, engine_launcher, resolve_launcher
from workbench.pool.ranks import rank_devices, visible_gpu_count
from workbench.pool.reaper import ReaperHandle
from workbench.pool.slurm import job_state, timeout_message, watch_message
from workbench.pool.state import StatePublisher, new_publisher, rank_rows
from workbench.pool.status import RankQueries
from workbench.pool.status import RankStatus as RankStatus  # re-exported: workbench.RankStatus
from workbench.pool.world import init_group, lay_out, recreate_group

log = logging.getLogger("workbench.pool.pool")
# The hub admits an engine only after its first heartbeat (ipyparallel's 3 s period made every
# start wait that long), and declares an engine dead after this many missed beats: an engine
# whose whole process tree vanished (a cancelled Slurm job, a lost host) has no nanny left to
# say so, and 6 x 0.5 s bounds how long a cell waits for it.
HEARTBEAT_ARGS = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=6"]
# One broadcast scheduler instead of a tree: a pool is a handful of ranks, and the tree's inner
# hops bind 127.0.0.1 whatever the controller's address, while a pool bound to the address the
# user gave must listen on that address only.
CONTROLLER_ARGS = [*HEARTBEAT_ARGS, "--IPController.broadcast_scheduler_depth=0"]


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
        self._reaper = ReaperHandle()  # stops the cluster if this process dies without stop()
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

    # the status queries, answered by ``self.ranks`` (``pool_status.RankQueries``)
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
                await self._start_cluster(n)
            except BaseException:
                await self._discard_cluster()  # nothing of a failed start is left running
                raise
        log.info("pool of %d ranks started in %.1f s", n, time.perf_counter() - t0)
        return self

    async def _start_cluster(self, n: int) -> None:
        kwargs = dict(self.cluster_kwargs)
        kwargs["controller_args"] = [*CONTROLLER_ARGS, *kwargs.get("controller_args", [])]
        devices = rank_devices(self.gpus) if self.launcher.engines == "local" else []
        config = cluster_config(self.launcher, n, devices)
        if "config" in kwargs:
            config.merge(kwargs.pop("config"))
        self.ranks.cluster = ipp.Cluster(
            n=n,
            engines=engine_launcher(self.launcher),
            controller_ip=self.launcher.controller_ip,
            log_level=logging.WARNING,
            config=config,
            **kwargs,
        )
        await self.cluster.start_controller()
        await self._start_engines(n)  # engines boot (and import torch) while the controller starts
        self._arm_reaper()
        self.ranks.client = await self.cluster.connect_client()
        await self._bootstrap(n, set())

    async def _discard_cluster(self) -> None:
        cluster, self.ranks.cluster, self.ranks.client = self.cluster, None, None
        self.ranks.clear()
        if cluster is not None:
            with _quiet(cluster), contextlib.suppress(Exception):
                await cluster.stop_cluster()
        self._reaper.disarm()

    async def _start_engines(self, n: int) -> None:
        """One engine set; local engines each see exactly one GPU of this host (their
        ``CUDA_VISIBLE_DEVICES``, set by the forking launcher), remote ones pick theirs by
        ``local_rank``."""
        assert self.cluster is not None
        self.ranks.engine_sets.append(await self.cluster.start_engines(n))

    async def _wait_for_new_engines(self, n: int, old: set[int]) -> list[int]:
        assert self.client is not None
        deadline = time.monotonic() + self.start_timeout_s
        next_check, jobs = 0.0, []
        while True:
            new = sorted(set(self.client.ids) - old)
            if len(new) >= n:
                self.progress = ""
                return new[:n]
            now = time.monotonic()
            if now >= next_check and self.slurm_jobs():
                jobs = await asyncio.to_thread(lambda: [job_state(j) for j in self.slurm_jobs()])
                self._note_progress(watch_message(jobs, self._log_dir()))
                next_check = now + 1.0
            if now > deadline:
                raise PoolError(timeout_message(len(new), n, self.start_timeout_s, jobs,
                                                self._log_dir()))
            await asyncio.sleep(0.05)

    def _note_progress(self, note: str) -> None:
        if note != self.progress:
            self.progress = note
            if note:
                self.state.update("starting", error=note)

    def _log_dir(self) -> str:
        return f"{self.cluster.profile_dir}/log" if self.cluster is not None else "the log"

    async def _bootstrap(self, n: int, old: set[int]) -> None:
        """Assign ranks to the new engines (grouped by host) and create the process group
        (``world.py``); the rank table is filled before the group forms, as a failed group
        still leaves engines to stop."""
        assert self.client is not None
        ids = await self._wait_for_new_engines(n, old)
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
            with _quiet(self.cluster):
                for set_id in self.ranks.engine_sets:
                    try:
                        await self.cluster.stop_engines(set_id)
                    except Exception as e:  # an engine set whose engines all died already
                        log.debug("stopping engine set %s: %s", set_id, e)
            self.ranks.clear()
            remove_dead_spill(self.pool_id)
            await self._start_engines(n)
            self._arm_reaper()
            await self._bootstrap(n, old)
        self.needs_reset = False
        return self

    @property
    def pool_id(self) -> str:
        """This pool's name among others on the host (its engines' spill folders carry it)."""
        return f"pool-{self.cluster.cluster_id}" if self.cluster is not None else "pool"

    def _arm_reaper(self) -> None:
        assert self.cluster is not None
        arm_reaper(self._reaper, self.cluster, self.slurm_jobs(), self.pool_id, self._log_dir())

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
        if self.client is not None and self.engine_ids:
            alive = [e for e in self.engine_ids if e in self.client.ids]
            if alive:
                ar = self.client[alive].apply_async(rank_calls.close_rank)
                await asyncio.to_thread(ar.wait, 10)
        try:
            if self.client is not None:
                self.client.close()
            with _quiet(self.cluster):
                await self.cluster.stop_cluster()
        finally:
            self.ranks.cluster, self.ranks.client = None, None
            self.ranks.clear()
            self._reaper.disarm()
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


@contextlib.contextmanager
def _quiet(cluster: ipp.Cluster) -> Iterator[None]:
    """Silence the cluster's logger while engines stop.

    Engines under ipykernel 7 exit with status 1 when stopped, and ipyparallel then logs their
    whole output as a warning into the cell; nothing in it is news to the user.
    """
    level = cluster.log.level
    cluster.log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        cluster.log.setLevel(level)
