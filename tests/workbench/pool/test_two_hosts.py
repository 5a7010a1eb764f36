"""A pool over two hosts, for real: two network namespaces with their own hostnames,
addresses, /etc/hosts and HOME, joined by a veth link (``helpers.hosts``); the notebook is a
real Jupyter kernel on host a; engines on both hosts, started once over SSH (an sshd on each
host) and once as a Slurm job over two slurmd nodes.

What is protected: ranks grouped by host with ``local_rank`` 0 and 1 on each; the DP losses of
one process on the whole batch; tensor-parallel groups of ``dp=2 tp=2`` inside one host and a
tp spanning hosts refused; the rendezvous on host a's network address; the controller listening
only on the address the user gave; connection files 0600 on both hosts (on host b: the copy
ipyparallel sent into b's own HOME); an engine killed on host b reported by rank and host
within 10 s, and restart bringing the pool back; hosts with a different workbench refused.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
from pathlib import Path

import pytest

import workbench

from helpers.hosts import TwoHosts
from helpers.kernel_session import KernelSession
from helpers.multinode import DP_CELL, TP_HOSTS_CELL, assert_same_losses, reference_losses
from helpers.prereq import require
from helpers.slurm_cluster import SlurmCluster, SlurmNode

pytestmark = [pytest.mark.engines, pytest.mark.full, pytest.mark.daemons]  # make test-daemons


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    require(["ip", "unshare", "sshd", "ssh", "ssh-keygen", "/usr/sbin/sshd"], root=True,
            why="two-host pool")
    pair = TwoHosts(tmp_path_factory.mktemp("hosts"))
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def kernel(hosts):
    k = KernelSession(prefix=hosts.a.wrap, socket_dir=str(hosts.dir))
    k.run_ok("%load_ext workbench")
    yield k
    k.close()


def _json(kernel: KernelSession, expr: str):
    text = kernel.run_ok(f"import json\nprint('JSON', json.dumps({expr}))").text
    return json.loads(text.split("JSON ", 1)[1].splitlines()[0])


def _start_ssh(kernel: KernelSession, hosts: TwoHosts) -> None:
    kernel.run_ok(f"%colossal start -n 4 --launcher ssh --hosts {hosts.a.name}:2,"
                  f"{hosts.b.name}:2 --controller-ip {hosts.a.addr}", timeout_s=240)


def _check_dp_and_hosts(kernel: KernelSession, hosts: TwoHosts) -> None:
    status = kernel.run_ok("%colossal status").text
    print(status)
    rows = [line.split() for line in status.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert [(r[2], int(r[3])) for r in rows] == [
        (hosts.a.name, 0), (hosts.a.name, 1), (hosts.b.name, 0), (hosts.b.name, 1)], status
    kernel.run_ok(f'%%colossal --plan "dp=4" --pull losses\n{DP_CELL}')
    assert_same_losses(_json(kernel, "losses"), reference_losses())


def test_ssh_pool_ranks_by_host_losses_tp_groups_rendezvous_and_security(kernel, hosts):
    _start_ssh(kernel, hosts)
    _check_dp_and_hosts(kernel, hosts)

    kernel.run_ok(f'%%colossal --plan "dp=2 tp=2" --pull all_tp_hosts\n{TP_HOSTS_CELL}')
    groups = _json(kernel, "all_tp_hosts")
    assert [len(set(hosts_of_group)) for _, hosts_of_group in groups] == [1, 1, 1, 1], groups
    across = kernel.run('%%colossal --plan "tp=4"\npass')
    assert across.status == "error" and "tensor-parallel group" in across.evalue, across.evalue

    kernel.run_ok("%%colossal --pull rendezvous\n"
                  "import torch.distributed as dist\nrendezvous = [None] * world_size\n"
                  "dist.all_gather_object(rendezvous, session.state.master_addr)")
    assert _json(kernel, "rendezvous") == [hosts.a.addr] * 4

    found = _json(kernel, (
        "(lambda pool, psutil: {'id': pool.cluster.cluster_id, 'listen': sorted({c.laddr.ip "
        "for p in [psutil.Process(pool.cluster.controller.process.pid), *psutil.Process("
        "pool.cluster.controller.process.pid).children(recursive=True)] "
        "for c in p.net_connections('tcp') if c.status == psutil.CONN_LISTEN})})"
        "(__import__('workbench.magics').magics.active_pool(), __import__('psutil'))"))
    assert found["listen"] == [hosts.a.addr], found
    security = ".ipython/profile_default/security"
    on_a = list((hosts.a.home / security).glob(f"ipcontroller-{found['id']}-*.json"))
    on_b = list((hosts.b.home / security).glob(f"ipcontroller-{found['id']}-*.json"))
    assert len(on_a) == 2 and on_b, (on_a, on_b)  # b received the engine file over ssh
    for f in on_a + on_b:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_engine_killed_on_the_second_host_is_reported_by_rank_and_host(kernel, hosts, tmp_path):
    stamp = tmp_path / "killed_at"
    msg_id = kernel.submit(
        "%%colossal\nimport os, signal, time\n"
        "if rank == 3:\n    time.sleep(1.0)\n"
        f"    open({str(stamp)!r}, 'w').write(repr(time.monotonic()))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n")
    reply = kernel.collect(msg_id, timeout_s=90)
    seconds = reply.received_at - float(stamp.read_text())
    print(f"rank 3 on {hosts.b.name} killed; reported after {seconds:.1f} s: {reply.evalue}")
    assert reply.ename == "RankFailureError"
    assert f"rank 3 on host {hosts.b.name} process died" in reply.evalue, reply.evalue
    assert "rank 2 on host" not in reply.evalue  # the waiting ranks are not blamed
    assert seconds < 10, f"reported after {seconds:.1f} s"

    kernel.run_ok("%colossal restart", timeout_s=240)
    _check_dp_and_hosts(kernel, hosts)
    kernel.run_ok("%colossal stop", timeout_s=120)


def test_a_host_with_another_workbench_version_is_refused_at_start(kernel, hosts, tmp_path):
    old = tmp_path / "old-install"
    shutil.copytree(Path(workbench.__file__).parent, old / "workbench",
                    ignore=shutil.ignore_patterns("__pycache__", "labextension", "static"))
    version = old / "workbench" / "version.py"
    text = version.read_text()
    assert f'__version__ = "{workbench.__version__}"' in text  # else the copy keeps our version
    version.write_text(text.replace(f'__version__ = "{workbench.__version__}"',
                                    '__version__ = "0.0.9"'))
    env_file = hosts.b.home / ".ssh" / "environment"  # sshd's per-user environment on b
    env_file.write_text(f"PYTHONPATH={old}\n")
    try:
        refused = kernel.run(f"%colossal start -n 2 --launcher ssh --hosts {hosts.a.name}:1,"
                             f"{hosts.b.name}:1 --controller-ip {hosts.a.addr}", timeout_s=240)
    finally:
        env_file.unlink()
    print(refused.evalue)
    assert refused.status == "error"
    assert f"workbench: 0.0.9 on {hosts.b.name}; {workbench.__version__} on {hosts.a.name}, " \
           "the notebook" in refused.evalue, refused.evalue
    assert "Install the same torch and colossal-workbench on every host" in refused.evalue
    assert "no pool is running" in kernel.run_ok("%colossal status").text


def test_slurm_pool_over_two_nodes(kernel, hosts, tmp_path):
    require(["slurmctld", "slurmd", "munged", "sbatch"], root=True, why="two-host Slurm pool")
    a = SlurmNode(hosts.a.name, hosts.a.addr, cpus=2, wrap=hosts.a.wrap)
    b = SlurmNode(hosts.b.name, hosts.b.addr, cpus=2, wrap=hosts.b.wrap)
    cluster = SlurmCluster(tmp_path, a, [a, b]).start()
    try:
        kernel.run_ok(f"import os\nos.environ['SLURM_CONF'] = {str(cluster.conf)!r}")
        kernel.run_ok(f"%colossal start -n 4 --launcher slurm --controller-ip {hosts.a.addr}",
                      timeout_s=240)
        _check_dp_and_hosts(kernel, hosts)
        kernel.run_ok("%colossal stop", timeout_s=120)
    finally:
        cluster.stop()
