"""``--launcher slurm`` on a real Slurm cluster (munged, slurmctld, slurmd from Debian,
started here and stopped afterwards): the engines are one batch job whose ``srun`` tasks
become ranks.

What is protected: the same DP losses as one process on the whole batch; a job waiting in
the queue is shown as pending with Slurm's own reason and gives up at the configurable start
timeout (the job cancelled, nothing left behind); ``scancel`` under a running cell is reported
like dead ranks, naming the job's state, and ``%colossal restart`` submits a new job that
trains again.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from workbench import RankFailureError
from workbench.magics import active_pool

from helpers.multinode import DP_CELL, assert_same_losses, reference_losses
from helpers.prereq import require
from helpers.slurm_cluster import SlurmCluster, SlurmNode

pytestmark = [pytest.mark.engines, pytest.mark.full, pytest.mark.daemons]  # make test-daemons


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require(["slurmctld", "slurmd", "munged", "sbatch"], root=True, why="Slurm launcher")
    import socket

    node = SlurmNode(socket.gethostname(), "127.0.0.1", cpus=4)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), node, [node]).start()
    old = {k: os.environ.get(k) for k in cluster.env()}
    os.environ.update(cluster.env())
    yield cluster
    cluster.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ip(slurm):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "workbench")
    yield shell
    shell.run_line_magic("colossal", "stop")


START = "start -n 4 --launcher slurm --controller-ip 127.0.0.1"


def test_dp_losses_scancel_mid_cell_and_restart(ip, slurm):
    ip.run_line_magic("colossal", START)
    pool = active_pool(ip)
    [job] = pool.slurm_jobs()
    ip.run_cell_magic("colossal", '--plan "dp=4" --pull losses', DP_CELL)
    assert_same_losses(ip.user_ns.pop("losses"), reference_losses())

    killer = threading.Timer(2.0, slurm.run, ("scancel", job))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(RankFailureError) as failed:
        ip.run_cell_magic("colossal", "", "import time\ntime.sleep(120)")
    seen_after = time.monotonic() - t0 - 2.0
    print(f"scancel reported {seen_after:.1f} s after it ran")
    assert failed.value.ranks == [0, 1, 2, 3]
    assert all(f.kind == "died" for f in failed.value.failures)
    assert f"Slurm job {job} CANCELLED" in str(failed.value), failed.value
    assert "restart" in failed.value.hint

    ip.run_line_magic("colossal", "restart")
    assert pool.slurm_jobs() != [job]  # a new job was submitted
    ip.run_cell_magic("colossal", '--plan "dp=4" --pull losses', DP_CELL)
    assert_same_losses(ip.user_ns.pop("losses"), reference_losses())
    ip.run_line_magic("colossal", "stop")


def test_a_pending_job_shows_slurms_reason_and_gives_up_at_the_start_timeout(ip, slurm, capsys):
    node = slurm.nodes[0].name
    slurm.set_node_state(node, "DRAIN", reason="maintenance")
    try:
        with pytest.raises(UsageError) as refused:
            ip.run_line_magic("colossal", f"{START} --start-timeout 8")
    finally:
        slurm.set_node_state(node, "RESUME")
    shown = capsys.readouterr().out
    print(shown, refused.value)
    # Slurm's reason, as squeue gives it (its wording for drained nodes moves on once the
    # scheduler has looked at the job)
    reason = r"pending \((ReqNodeNotAvail|Nodes required for job are DOWN, DRAINED)"
    assert re.search(reason, shown), shown
    assert re.search(reason, str(refused.value)), refused.value
    assert "start timeout of 8 s" in str(refused.value) and "--start-timeout" in str(refused.value)
    assert slurm.run("squeue", "-h", "-t", "PENDING,RUNNING").strip() == ""  # cancelled
    assert active_pool(ip) is None or not active_pool(ip).started
