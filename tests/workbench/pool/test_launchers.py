"""Launcher configuration, rank assignment by host and the version check, without engines.

What is protected: every launcher starts engines through ``workbench.pool.rank_process`` (torch
imported while the controller starts); MPI, Slurm and SSH get their settings from the pool's
options and refuse bad ones in words; ranks of one host are adjacent with ``local_rank``
counting inside the host (so tp groups stay inside hosts); hosts with other torch or workbench
versions are refused naming who runs what; the launcher's own rank variables are read as the
launcher set them.
"""

from __future__ import annotations

import sys

import pytest

from kernels_runtime.launcher_env import launcher_rank
from workbench import PoolError
from workbench.pool.launchers import cluster_config, parse_hosts, resolve_launcher
from workbench.pool.ranks import assign_ranks, check_versions, tp_groups_within_hosts

from helpers.prereq import require


def test_every_launcher_starts_the_workbench_engine_entry():
    for name, extra in (("local", {}), ("mpi", {}), ("ssh", {"hosts": "a:2,b:2"})):
        spec = resolve_launcher(name, "10.0.0.1" if name == "ssh" else None, **extra)
        c = cluster_config(spec, 4)
        assert c[spec.launcher_class].engine_cmd[1:] == ["-m", "workbench.pool.rank_process"]
    # engines on this host read the connection file as soon as it exists (start overlap)
    assert cluster_config(resolve_launcher("local", None), 2).Cluster \
        .send_engines_connection_env is False


def test_mpi_uses_this_environments_mpiexec_and_oversubscribes_past_the_cores():
    spec = resolve_launcher("mpi", None)
    c = cluster_config(spec, 64).MPIEngineSetLauncher
    assert c.mpi_cmd[0].endswith("mpiexec")
    assert "--oversubscribe" in c.mpi_args and c.mpi_args[:2] == ["--bind-to", "none"]


def test_ssh_needs_hosts_whose_engines_add_up_to_n():
    with pytest.raises(PoolError, match="needs the hosts"):
        resolve_launcher("ssh", "10.0.0.1")
    spec = resolve_launcher("ssh", "10.0.0.1", hosts="a:2,b:2", remote_python="/opt/py")
    c = cluster_config(spec, 4).SSHEngineSetLauncher
    assert c.engines == {"a": 2, "b": 2} and c.remote_python == "/opt/py"
    assert c.engine_cmd == ["/opt/py", "-m", "workbench.pool.rank_process"]
    with pytest.raises(PoolError, match="hold 4 engines"):
        cluster_config(spec, 3)
    with pytest.raises(PoolError, match="host:engines"):
        parse_hosts("a:two")
    with pytest.raises(PoolError, match="at least 1"):
        parse_hosts("a:0")
    with pytest.raises(PoolError, match="hosts are for the ssh launcher"):
        resolve_launcher("local", None, hosts="a:2")


def test_slurm_without_sbatch_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without Slurm's client
    spec = resolve_launcher("slurm", "10.0.0.1", options=["--ntasks-per-node=2"])
    with pytest.raises(PoolError, match="needs Slurm's sbatch"):
        cluster_config(spec, 4)


def test_slurm_options_become_sbatch_lines():
    require(["sbatch"], why="the Slurm launcher's batch template")
    spec = resolve_launcher("slurm", "10.0.0.1", options=["--ntasks-per-node=2"])
    template = cluster_config(spec, 4).SlurmEngineSetLauncher.batch_template
    assert "#SBATCH --ntasks-per-node=2" in template and "srun {program_and_args}" in template
    with pytest.raises(PoolError, match="sbatch options"):
        cluster_config(resolve_launcher("slurm", "10.0.0.1", options=["partition"]), 4)


def test_ranks_are_grouped_by_host_with_local_ranks():
    idents = [{"host": h, "gpu": "", "launcher_rank": None} for h in "babaab"]
    layout = assign_ranks(idents, [10, 11, 12, 13, 14, 15])
    assert layout.hosts == ["a", "a", "a", "b", "b", "b"]
    assert layout.local_ranks == [0, 1, 2, 0, 1, 2] and layout.local_sizes == [3] * 6
    assert [idents[i]["host"] for i in layout.order] == layout.hosts
    # the launcher's ranks order hosts (MPI rank 0's host first) and ranks inside them
    mpi = [{"host": h, "gpu": "", "launcher_rank": r} for h, r in
           (("z", 0), ("a", 3), ("z", 1), ("a", 2))]
    assert assign_ranks(mpi, [1, 2, 3, 4]).order == [0, 2, 3, 1]


def test_tp_groups_must_stay_inside_hosts():
    hosts = ["a", "a", "b", "b"]
    assert tp_groups_within_hosts(hosts, 2) is None
    assert "tp=4" in tp_groups_within_hosts(hosts, 4) and "per host (2)" in \
        tp_groups_within_hosts(hosts, 4)
    assert tp_groups_within_hosts(["a"] * 4, 4) is None


def test_hosts_with_other_versions_are_refused_by_name():
    same = [{"host": "a", "torch": "2.13.0", "workbench": "0.1.0"},
            {"host": "b", "torch": "2.13.0", "workbench": "0.1.0"}]
    check_versions(same, {"torch": "2.13.0", "workbench": "0.1.0"})
    other = [same[0], {"host": "b", "torch": "2.12.1", "workbench": "0.1.0"}]
    with pytest.raises(PoolError, match=r"torch: 2\.12\.1 on b; 2\.13\.0 on a, the notebook"):
        check_versions(other, {"torch": "2.13.0", "workbench": "0.1.0"})
    # a CPU build in the notebook and CUDA builds on the hosts: the same release
    cuda = [{**i, "torch": "2.13.0+cu126"} for i in same]
    check_versions(cuda, {"torch": "2.13.0+cpu", "workbench": "0.1.0"})


def test_launcher_ranks_are_read_from_mpi_and_slurm_variables():
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                          "OMPI_COMM_WORLD_SIZE": "4"}) == {
        "launcher": "mpi", "launcher_rank": 3, "launcher_local_rank": 1, "launcher_size": 4}
    assert launcher_rank({"SLURM_PROCID": "2", "SLURM_LOCALID": "0"})["launcher"] == "slurm"
    assert launcher_rank({})["launcher_rank"] is None


def test_engine_entry_point_is_importable_without_running():
    import workbench.pool.rank_process as entry

    assert callable(entry.main) and "workbench.pool.rank_process" in sys.modules


def test_local_engines_are_forked_from_one_process_with_a_device_each():
    from workbench.pool.forked_ranks import ForkedEngineSetLauncher

    spec = resolve_launcher("local", None)
    config = cluster_config(spec, 4, devices=["0", "1"])
    launcher = ForkedEngineSetLauncher(config=config,
                                       engine_cmd=["py", "-m", "workbench.pool.rank_process"])
    launcher.n = 4
    assert launcher.find_args() == ["py", "-m", "workbench.pool.rank_process", "--workbench-fork=4",
                                    "--workbench-devices=0,1"]


def test_local_ranks_stay_on_the_gpus_this_process_was_given(monkeypatch):
    """A hub's spawner gave this server GPU 3 only: its ranks get "3", never "0" (someone
    else's); without a list of its own, ranks count from 0."""
    from workbench.pool.ranks import rank_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert rank_devices(1) == ["3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a, 5")
    assert rank_devices(2) == ["GPU-8f2a", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert rank_devices(2) == ["0", "1"]
