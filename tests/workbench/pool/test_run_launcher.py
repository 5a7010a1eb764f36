"""``workbench run NB --launcher L -n N [--nodes K]``: one notebook on a fresh pool from any
launcher, unedited.

What is protected. Fast: ``workbench run`` and ``%colossal start`` parse the same launch
options (one declaration, ``workbench.pool.start_options``), the run's options reach the magic
through ``$WORKBENCH_START_OPTIONS`` and win over the notebook's line (``--launcher-option``s
add up), ``--nodes`` is refused for launchers that cannot place ranks on a number of nodes
before anything runs, and the report goes beside the saved notebook. Full tier: the real CLI
runs notebook 01 on a real Slurm cluster (the notebook says ``%colossal start -n 2``; the
command line adds ``--launcher slurm``): the executed notebook has its outputs, the job went
through Slurm's queue, and the dashboard report is written beside it; with ``--nodes 2`` on a
two-node cluster (two network namespaces, ``helpers.hosts``) that one job spans both nodes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from workbench.cli import main
from workbench.notebook_runner import report_path
from workbench.pool.start_options import ENV, add_launch_options, to_line, with_env_options

NOTEBOOKS = Path(__file__).resolve().parents[3] / "notebooks"


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_options(parser)
    parser.add_argument("--nodes", type=int, default=None)
    return parser.parse_args(argv)


def _magic(line: str, environ: dict[str, str]) -> argparse.Namespace:
    from workbench.magics import parsers

    pool_parser = parsers()[0]
    return pool_parser.parse_argstring(with_env_options(line, environ))


def test_defaults_give_no_options_and_every_option_round_trips_into_the_magic():
    assert to_line(_cli()) == ""
    args = _cli("--launcher", "slurm", "--ranks", "4", "--controller-ip", "10.0.0.5",
                "--backend", "gloo", "--launcher-option=--partition=gpu",
                "--launcher-option=--time=1:00:00", "--start-timeout", "300", "--nodes", "2")
    line = to_line(args, args.nodes)
    assert line == ("-n 4 --backend gloo --launcher slurm --controller-ip 10.0.0.5 "
                    "--launcher-option=--partition=gpu --launcher-option=--time=1:00:00 "
                    "--start-timeout 300.0 --launcher-option=--nodes=2")
    seen = _magic("start", {ENV: line})
    assert (seen.command, seen.n, seen.launcher, seen.controller_ip, seen.backend,
            seen.start_timeout) == ("start", 4, "slurm", "10.0.0.5", "gloo", 300.0)
    assert seen.launcher_options == ["--partition=gpu", "--time=1:00:00", "--nodes=2"]


def test_the_command_line_wins_over_the_notebooks_start_line_and_options_add_up():
    line = to_line(_cli("-n", "4", "--launcher", "slurm", "--launcher-option=--qos=high"))
    seen = _magic("start -n 2 --launcher-option=--partition=cpu", {ENV: line})
    assert (seen.n, seen.launcher) == (4, "slurm")
    assert seen.launcher_options == ["--partition=cpu", "--qos=high"]
    untouched = _magic("start -n 2", {})  # a kernel workbench run did not start
    assert (untouched.n, untouched.launcher, untouched.launcher_options) == (2, "local", [])


def test_nodes_is_refused_for_launchers_that_cannot_place_ranks_on_nodes(capsys):
    with pytest.raises(ValueError, match=r"only --launcher slurm .* \(--hosts node1:2,"):
        to_line(_cli("--launcher", "ssh"), nodes=2)
    with pytest.raises(ValueError, match="--nodes 0: give at least 1"):
        to_line(_cli("--launcher", "slurm"), nodes=0)
    # refused by the command before any kernel starts: the notebook need not even exist
    assert main(["run", "missing.ipynb", "--nodes", "2"]) == 2
    assert "only --launcher slurm places ranks" in capsys.readouterr().err


def test_the_help_documents_how_the_options_reach_the_notebook(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = capsys.readouterr().out
    for words in ("--launcher", "--ranks", "--nodes", "--launcher-option", "--controller-ip",
                  "$WORKBENCH_START_OPTIONS", "NAME.report.html"):
        assert words in shown, words


def test_the_report_goes_beside_the_saved_notebook(tmp_path):
    assert report_path(tmp_path / "out" / "run.ipynb") == tmp_path / "out" / "run.report.html"


def _run_notebook_01(saved: Path, cluster, *options: str, wrap: tuple[str, ...] = ()):
    """``workbench run`` of notebook 01 with ``options``, on the host ``wrap`` enters."""
    import os

    saved.parent.mkdir(parents=True, exist_ok=True)
    # 40 steps: fewer would stop at the notebook's own check that the loss fell by a quarter
    done = subprocess.run(
        [*wrap, sys.executable, "-m", "workbench.cli", "run",
         str(NOTEBOOKS / "01_pretrain_gpt.ipynb"), "-p", "STEPS=40", *options,
         "--save", str(saved)],
        capture_output=True, text=True, timeout=900, cwd=saved.parent,
        env=dict(os.environ, **cluster.env()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^step   39  loss \d", done.stdout, re.M), done.stdout[-2000:]
    executed = nbformat.read(saved, as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "a cell did not run"
    assert not any("dashboard report:" in str(c.outputs) for c in code[-1:]), \
        "the runner's report cell was saved in the notebook"
    report = report_path(saved)
    assert report.is_file() and "plotly" in report.read_text()[:200000], report
    # the controller keeps finished jobs for MinJobAge (300 s): (id, state, nodes, node list).
    # A COMPLETING job counts only the nodes still finishing (each is released as its epilog
    # ends), so the record is read once the job has left that state.
    deadline = time.monotonic() + 60
    while True:
        jobs = [j.split() for j in cluster.run("squeue", "-h", "-t", "all", "-o",
                                               "%i %T %D %N").splitlines() if j.strip()]
        if not any(job[1] == "COMPLETING" for job in jobs) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print("Slurm jobs (id, state, nodes, node list):", jobs)
    return done, code, jobs


@pytest.mark.full
@pytest.mark.engines
@pytest.mark.daemons
def test_workbench_run_trains_notebook_01_on_a_slurm_pool(tmp_path, slurm):
    done, code, jobs = _run_notebook_01(
        tmp_path / "out" / "run.ipynb", slurm, "--launcher", "slurm", "--controller-ip",
        "127.0.0.1", "-n", "2")
    assert "== pools start with: -n 2 --launcher slurm --controller-ip 127.0.0.1" in done.stdout
    assert "colossal: 2 ranks on gloo ready" in str(code[0].outputs), code[0].outputs
    # the pool was one Slurm batch job, finished by the notebook's %colossal stop
    assert len(jobs) == 1 and jobs[0][1] in ("COMPLETED", "CANCELLED", "COMPLETING"), jobs


@pytest.fixture
def two_hosts(tmp_path_factory):
    from helpers.hosts import TwoHosts
    from helpers.prereq import require

    require(["ip", "unshare", "sshd", "ssh", "ssh-keygen", "/usr/sbin/sshd", "slurmctld",
             "slurmd", "munged", "sbatch"], root=True, why="two-node Slurm pool")
    pair = TwoHosts(tmp_path_factory.mktemp("hosts"))
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.mark.full
@pytest.mark.engines
@pytest.mark.daemons
def test_workbench_run_nodes_2_spreads_the_ranks_over_two_slurm_nodes(tmp_path, two_hosts):
    from helpers.slurm_cluster import SlurmCluster, SlurmNode

    a, b = (SlurmNode(h.name, h.addr, cpus=2, wrap=h.wrap) for h in two_hosts.hosts)
    cluster = SlurmCluster(tmp_path / "slurm", a, [a, b]).start()
    try:
        done, code, jobs = _run_notebook_01(
            tmp_path / "out" / "run.ipynb", cluster, "--launcher", "slurm", "--controller-ip",
            two_hosts.a.addr, "-n", "2", "--nodes", "2", wrap=tuple(two_hosts.a.wrap))
    finally:
        cluster.stop()
    assert "--launcher-option=--nodes=2" in done.stdout
    assert len(jobs) == 1 and jobs[0][2] == "2", jobs  # one job on both nodes
    assert all(h.name in jobs[0][3] for h in two_hosts.hosts), jobs
