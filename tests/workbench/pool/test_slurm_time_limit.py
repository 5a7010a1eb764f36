"""The engine job's time limit as a real Slurm reads it (munged, slurmctld, slurmd started by
the ``slurm`` fixture; the partition has no limit of its own, ``MaxTime=INFINITE``).

What is protected: the batch script the Slurm launcher submits makes Slurm record a one-day
limit when the options give none, and the user's ``--time`` when they do; ``test_slurm_script``
checks the text, this checks that sbatch reads the text that way.
"""

from __future__ import annotations

import re

import pytest

from workbench.pool.launchers import slurm_batch_template

pytestmark = pytest.mark.full  # real daemons: make test-full


def _time_limit(slurm, tmp_path, options: list[str]) -> str:
    """Submit the launcher's script for ``options`` (held, so it never runs) and read the
    job's TimeLimit back from scontrol."""
    script = tmp_path / "engines.sbatch"
    script.write_text(slurm_batch_template(options).format(
        cluster_id="limit", n=1, output_file=str(tmp_path / "out.log"),
        program_and_args="true"))
    job = slurm.run("sbatch", "--parsable", "--hold", str(script)).strip().split(";")[0]
    try:
        shown = slurm.run("scontrol", "-o", "show", "job", job)
    finally:
        slurm.run("scancel", job, check=False)
    found = re.search(r"\bTimeLimit=(\S+)", shown)
    assert found, shown
    return found.group(1)


def test_sbatch_records_the_default_and_the_users_limit(slurm, tmp_path) -> None:
    assert _time_limit(slurm, tmp_path, ["--ntasks-per-node=1"]) == "1-00:00:00"
    assert _time_limit(slurm, tmp_path, ["--time=00:30:00"]) == "00:30:00"
