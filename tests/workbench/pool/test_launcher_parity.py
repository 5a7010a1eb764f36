"""The same data-parallel training cell on 4 ranks gives the same losses whether ipyparallel
started the engines itself (local) or through Open MPI's ``mpiexec`` (``--launcher mpi``),
and both equal one process training on the whole batch.

Under MPI the ranks and the rendezvous come from MPI: rank r is MPI rank r, and rank 0's
address reached every rank through an MPI broadcast. Open MPI and mpi4py are the PyPI wheels of
the ``[mpi]`` extra (installed by ``make``); as root, Open MPI's documented opt-in variables
are set by the launcher configuration.
"""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

from helpers.multinode import DP_CELL, assert_same_losses, reference_losses

pytestmark = [pytest.mark.engines, pytest.mark.slow]


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "workbench")
    yield shell
    shell.run_line_magic("colossal", "stop")


@pytest.mark.parametrize("launcher", [
    "local", pytest.param("mpi", marks=pytest.mark.full)])  # Open MPI's mpiexec: test-full
def test_dp_losses_match_the_one_process_reference(ip, launcher):
    ip.run_line_magic("colossal", f"start -n 4 --launcher {launcher}")
    try:
        ip.run_cell_magic("colossal", '--plan "dp=4" --pull losses', DP_CELL)
        assert_same_losses(ip.user_ns.pop("losses"), reference_losses())
        if launcher == "mpi":
            ip.run_cell_magic(
                "colossal", "--pull mpi_ranks",
                "import os\nfrom mpi4py import MPI\nimport torch.distributed as dist\n"
                "mine = (rank, MPI.COMM_WORLD.Get_rank(), session.state.master_addr,"
                " session.state.master_port)\nmpi_ranks = [None] * world_size\n"
                "dist.all_gather_object(mpi_ranks, mine)\n")
            ranks = ip.user_ns.pop("mpi_ranks")
            assert [r[:2] for r in ranks] == [(r, r) for r in range(4)], ranks
            assert len({r[2:] for r in ranks}) == 1  # one rendezvous, broadcast by MPI
    finally:
        ip.run_line_magic("colossal", "stop")
