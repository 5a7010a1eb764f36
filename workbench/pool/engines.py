"""The processes behind a pool: one ipyparallel cluster (a controller and engine sets), started,
waited for, replaced and stopped.

Why apart from ``pool.py``: a ``Pool`` is what a notebook holds (the ranks of one
torch.distributed world, their status, their published state, blocking twins of every call);
this is what it takes to have processes at all, and it is the same whatever the world does with
them: the controller's arguments, one engine set per (re)start, waiting for engines (a Slurm
job in the queue included, with what it waits for reported as it changes), the reaper that
stops them if this process dies, and stopping them without the noise ipyparallel makes.

An ``EngineCluster`` keeps its cluster and client in the pool's ``RankQueries`` (``status.py``),
which owns the rank table they belong to: the engine sets it starts are recorded there, and the
table is cleared whenever the engines go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import ipyparallel as ipp

from workbench.errors import PoolError
from workbench.pool import rank_calls
from workbench.pool.cleanup import arm_reaper, remove_dead_spill
from workbench.pool.launchers import LauncherSpec, cluster_config, engine_launcher
from workbench.pool.ranks import rank_devices
from workbench.pool.reaper import ReaperHandle
from workbench.pool.slurm import job_state, timeout_message, watch_message
from workbench.pool.status import RankQueries

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


class EngineCluster:
    """A pool's ipyparallel cluster (see the module doc); ``ranks`` is where its cluster,
    client and engine sets are kept, and ``on_progress(note)`` hears what a start waits for."""

    def __init__(self, launcher: LauncherSpec, ranks: RankQueries,
                 on_progress: Callable[[str], None]) -> None:
        self.launcher = launcher
        self.ranks = ranks
        self.on_progress = on_progress
        self.reaper = ReaperHandle()  # stops the cluster if this process dies without stop()

    @property
    def cluster(self) -> ipp.Cluster | None:
        return self.ranks.cluster

    @property
    def pool_id(self) -> str:
        """This pool's name among others on the host (its engines' spill folders carry it)."""
        return f"pool-{self.cluster.cluster_id}" if self.cluster is not None else "pool"

    def log_dir(self) -> str:
        return f"{self.cluster.profile_dir}/log" if self.cluster is not None else "the log"

    async def start(self, n: int, gpus: int, cluster_kwargs: dict[str, Any]) -> None:
        """The controller and ``n`` engines (each local one seeing one of ``gpus`` GPUs), the
        reaper armed and a client connected."""
        kwargs = dict(cluster_kwargs)
        kwargs["controller_args"] = [*CONTROLLER_ARGS, *kwargs.get("controller_args", [])]
        devices = rank_devices(gpus) if self.launcher.engines == "local" else []
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
        await self.start_engines(n)  # engines boot (and import torch) while the controller starts
        self.arm_reaper()
        self.ranks.client = await self.cluster.connect_client()

    async def start_engines(self, n: int) -> None:
        """One engine set; local engines each see exactly one GPU of this host (their
        ``CUDA_VISIBLE_DEVICES``, set by the forking launcher), remote ones pick theirs by
        ``local_rank``."""
        assert self.cluster is not None
        self.ranks.engine_sets.append(await self.cluster.start_engines(n))

    async def replace_engines(self, n: int) -> None:
        """Stop every engine set (the rank table goes with them), then start ``n`` fresh
        engines."""
        assert self.cluster is not None
        with quiet(self.cluster):
            for set_id in self.ranks.engine_sets:
                try:
                    await self.cluster.stop_engines(set_id)
                except Exception as e:  # an engine set whose engines all died already
                    log.debug("stopping engine set %s: %s", set_id, e)
        self.ranks.clear()
        remove_dead_spill(self.pool_id)
        await self.start_engines(n)
        self.arm_reaper()

    async def wait_for_new_engines(self, n: int, old: set[int], timeout_s: float) -> list[int]:
        """The ids of ``n`` engines not in ``old``, once registered; raises after
        ``timeout_s`` saying what was still missing (and, under Slurm, why)."""
        client = self.ranks.client
        assert client is not None
        deadline = time.monotonic() + timeout_s
        next_check, jobs = 0.0, []
        while True:
            new = sorted(set(client.ids) - old)
            if len(new) >= n:
                self.on_progress("")
                return new[:n]
            now = time.monotonic()
            if now >= next_check and self.ranks.slurm_jobs():
                jobs = await asyncio.to_thread(
                    lambda: [job_state(j) for j in self.ranks.slurm_jobs()])
                self.on_progress(watch_message(jobs, self.log_dir()))
                next_check = now + 1.0
            if now > deadline:
                raise PoolError(timeout_message(len(new), n, timeout_s, jobs, self.log_dir()))
            await asyncio.sleep(0.05)

    def arm_reaper(self) -> None:
        assert self.cluster is not None
        arm_reaper(self.reaper, self.cluster, self.ranks.slurm_jobs(), self.pool_id,
                   self.log_dir())

    async def discard(self) -> None:
        """Stop whatever a failed start left running; errors are swallowed (the start's own
        error is the one to see)."""
        cluster, self.ranks.cluster, self.ranks.client = self.cluster, None, None
        self.ranks.clear()
        if cluster is not None:
            with quiet(cluster), contextlib.suppress(Exception):
                await cluster.stop_cluster()
        self.reaper.disarm()

    async def stop(self) -> None:
        """Close every live rank (up to 10 s), then the client and the cluster; the rank
        table is cleared and the reaper disarmed even if stopping fails."""
        cluster, client, engine_ids = self.cluster, self.ranks.client, self.ranks.engine_ids
        assert cluster is not None
        if client is not None and engine_ids:
            alive = [e for e in engine_ids if e in client.ids]
            if alive:
                ar = client[alive].apply_async(rank_calls.close_rank)
                await asyncio.to_thread(ar.wait, 10)
        try:
            if client is not None:
                client.close()
            with quiet(cluster):
                await cluster.stop_cluster()
        finally:
            self.ranks.cluster, self.ranks.client = None, None
            self.ranks.clear()
            self.reaper.disarm()


@contextlib.contextmanager
def quiet(cluster: ipp.Cluster) -> Iterator[None]:
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
