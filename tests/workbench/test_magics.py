"""``%colossal`` and ``%%colossal`` on a real 2-rank pool (ipyparallel engines, gloo)."""

from __future__ import annotations

import time

import pytest
from IPython.core.error import UsageError

from workbench.errors import RankFailureError
from workbench.magics import ColossalMagics, active_pool

pytestmark = pytest.mark.engines


def cell(ip, line, code):
    return ip.run_cell_magic("colossal", line, code)


def test_all_reduce_shows_rank0_output_only(shell, capsys):
    cell(shell, "", "import torch\nt = torch.full((3,), float(rank + 1))\ncomm.all_reduce(t)\n"
                    "print(f'rank {rank}: {t.tolist()}')")
    out = capsys.readouterr().out
    assert "rank 0: [3.0, 3.0, 3.0]" in out
    assert "rank 1:" not in out


def test_output_all_prefixes_every_rank(shell, capsys):
    cell(shell, "--output all", "print('line one')\nprint('line two', world_size)")
    out = capsys.readouterr().out.splitlines()
    for r in (0, 1):
        assert f"[rank {r}] line one" in out
        assert f"[rank {r}] line two 2" in out


def test_push_and_pull_round_trip(shell):
    shell.user_ns["base"] = 10
    cell(shell, "--push base --pull answer", "answer = base + rank + 100")
    assert shell.user_ns["answer"] == 110  # pulled from rank 0


def test_targets_run_only_on_chosen_ranks(shell, capsys):
    cell(shell, "--targets 1 --pull who", "who = rank")
    assert shell.user_ns["who"] == 1


def test_plan_is_parsed_validated_and_predefined(shell):
    cell(shell, '--plan "dp=2 zero=1 bf16" --pull seen', "seen = (plan.dp, plan.zero_stage, "
                                                         "plan.precision)")
    assert shell.user_ns["seen"] == (2, 1, "bf16")


def test_invalid_plan_fails_before_any_rank_runs(shell):
    shell.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match="dp\\*tp\\*pp\\*sp"):
        cell(shell, '--plan "dp=3" --pull ran', "ran = True")
    assert "ran" not in shell.user_ns


@pytest.mark.parametrize("line, message", [
    ("--output everyone", "invalid choice"),
    ("--targets 0,7", "ranks must be in 0..1"),
    ("--targets a", "integers"),
    ("--push not_defined_anywhere", "not defined in the notebook"),
    ("--bogus", "unrecognized arguments"),
])
def test_bad_options_give_argparse_style_errors(shell, line, message):
    with pytest.raises(UsageError, match=message):
        cell(shell, line, "pass")


def test_exception_on_rank1_only_names_rank1(shell):
    with pytest.raises(RankFailureError) as info:
        cell(shell, "", "if rank == 1:\n    raise ValueError('bad shard 7')\n")
    err = info.value
    assert err.ranks == [1]
    assert "ValueError: bad shard 7" in str(err)
    rendered = "\n".join(err._render_traceback_())
    assert "rank 1" in rendered and "rank 0" not in rendered
    cell(shell, "", "x = 1")  # next cell works


def test_identical_failures_are_grouped(shell):
    with pytest.raises(RankFailureError) as info:
        cell(shell, "", "raise KeyError('same everywhere')")
    assert info.value.ranks == [0, 1]
    assert len(info.value.groups()) == 1
    assert "ranks 0, 1" in str(info.value)


def test_collective_skipped_by_one_rank_times_out_naming_the_op(shell):
    t0 = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        cell(shell, "", "import torch\nif rank == 0:\n    comm.all_reduce(torch.ones(4))\n")
    elapsed = time.monotonic() - t0
    assert info.value.ranks == [0]
    assert "all_reduce" in str(info.value)
    assert elapsed < 5 + 10, f"took {elapsed:.1f} s with a 5 s collective timeout"
    # the broken process group is re-created before the next cell
    cell(shell, "--pull s", "import torch\nt = torch.ones(1)\ncomm.all_reduce(t)\ns = t.item()")
    assert shell.user_ns["s"] == 2.0


def test_status_lists_every_rank(shell, capsys):
    shell.run_line_magic("colossal", "status")
    out = capsys.readouterr().out
    assert "gloo" in out and "idle" in out
    rows = active_pool(shell).status()
    assert [r.rank for r in rows] == [0, 1]
    assert all(r.state == "idle" and r.memory["host_rss"] > 0 for r in rows)
    assert len({r.pid for r in rows}) == 2


def test_cell_without_pool_says_how_to_start_one(shell):
    magics = ColossalMagics(shell)  # a second instance that never started a pool
    with pytest.raises(UsageError, match="%colossal start"):
        magics.colossal("", "print(1)")


def test_bad_line_command(shell):
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("colossal", "launch")
