"""``Pool`` lifecycle and its security defaults, with real engines."""

from __future__ import annotations

import glob
import json
import os
import stat

import ipyparallel as ipp
import psutil
import pytest

from workbench import Pool, PoolError
from workbench.pool.forked_ranks import ForkedEngineSetLauncher
from workbench.pool.launchers import resolve_launcher

pytestmark = pytest.mark.engines


def _all_reduce_sum(pool: Pool) -> list[float]:
    ar = pool.view().execute(
        "import torch\n_t = torch.ones(1) * (rank + 1)\ncomm.all_reduce(_t)\n_v = _t.item()"
    )
    ar.get()
    return pool.view().pull("_v", block=True)


def test_pool_lifecycle_ranks_and_security():
    with Pool(n=2) as pool:
        assert pool.world_size == 2 and pool.backend == "gloo"
        assert pool.view().pull("rank", block=True) == [0, 1]
        assert _all_reduce_sum(pool) == [3.0, 3.0]

        # controller listens on loopback only
        controller = psutil.Process(pool.cluster.controller.process.pid)
        procs = [controller, *controller.children(recursive=True)]
        listening = [c.laddr.ip for p in procs for c in p.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and set(listening) == {"127.0.0.1"}, listening

        # connection files hold the HMAC key: owner read/write only
        files = glob.glob(os.path.join(pool.cluster.profile_dir, "security",
                                       f"ipcontroller-{pool.cluster.cluster_id}-*.json"))
        assert files
        for f in files:
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f

        # ipyparallel's own loaders (the Jupyter server's cluster list) read the cluster file
        # back with our launcher class (its entry point), not "could not be imported"
        with open(pool.cluster.cluster_file) as f:
            assert json.load(f)["engines"]["class"] == "workbench_forked"
        again = ipp.Cluster.from_file(pool.cluster.cluster_file)
        assert again.engine_launcher_class is ForkedEngineSetLauncher
        assert list(again.engines) == list(pool.cluster.engines)

        # restart: new engine ids, ranks reassigned 0..n-1, process group works again
        old_ids = list(pool.engine_ids)
        pool.restart()
        assert set(pool.engine_ids).isdisjoint(old_ids)
        assert pool.view().pull("rank", block=True) == [0, 1]
        assert _all_reduce_sum(pool) == [3.0, 3.0]
    assert not pool.started


def test_async_twin_starts_and_stops():
    import asyncio

    async def main():
        pool = Pool(n=2)
        await pool.start_async()
        ranks = pool.view().pull("rank", block=True)
        await pool.stop_async()
        return ranks

    assert asyncio.run(main()) == [0, 1]


@pytest.mark.parametrize("launcher", ["ssh", "slurm", "pbs"])
def test_remote_launchers_require_explicit_controller_address(launcher):
    with pytest.raises(PoolError, match="controller_ip"):
        Pool(launcher=launcher)
    spec = resolve_launcher(launcher, "10.1.2.3", hosts="n1:2" if launcher == "ssh" else None)
    assert spec.controller_ip == "10.1.2.3" and spec.remote


def test_defaults_bind_loopback_and_reject_unknown_input():
    assert resolve_launcher("local", None).controller_ip == "127.0.0.1"
    with pytest.raises(PoolError, match="unknown launcher"):
        Pool(launcher="kubernetes")
    with pytest.raises(PoolError, match="at least one rank"):
        Pool(n=0)
    with pytest.raises(PoolError, match="backend"):
        Pool(backend="mpi")


def test_status_before_start_says_how_to_start():
    with pytest.raises(PoolError, match="%colossal start"):
        Pool(n=2).status()
