"""``%colossal`` and ``%%colossal`` on a real 2-rank pool (ipyparallel engines, gloo)."""

from __future__ import annotations

import os
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


def test_push_line_sends_named_variables_to_every_rank(shell, capsys):
    """``%colossal push a b`` is the cell's ``--push`` without a cell; an undefined name is
    refused before anything is sent."""
    shell.user_ns.update(scale=3, words=["a", "b"])
    shell.run_line_magic("colossal", "push scale words")
    assert "sent scale, words to ranks 0, 1" in capsys.readouterr().out
    cell(shell, "--output all", "print('seen', rank, scale * len(words))")
    out = capsys.readouterr().out
    assert "[rank 0] seen 0 6" in out and "[rank 1] seen 1 6" in out, out
    shell.user_ns["scale"] = 5
    shell.run_line_magic("colossal", "push scale --targets 1")
    cell(shell, "--targets 0 --pull scale", "pass")
    assert shell.user_ns["scale"] == 3  # rank 0 kept the first value
    with pytest.raises(UsageError, match="push: not defined in the notebook: nowhere"):
        shell.run_line_magic("colossal", "push scale,nowhere")
    with pytest.raises(UsageError, match="name the notebook variables"):
        shell.run_line_magic("colossal", "push")


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
    # a rank may still be finishing what the cell before left it (perhaps the status magic's
    # describe call, if it outlived its 5 s wait on a loaded machine): each must become idle
    # within 30 s, and an idle rank reports its memory
    deadline = time.monotonic() + 30
    rows = active_pool(shell).status()
    while any(r.state != "idle" for r in rows) and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = active_pool(shell).status()
    assert [r.rank for r in rows] == [0, 1]
    assert all(r.state == "idle" and r.memory["host_rss"] > 0 for r in rows), rows
    assert len({r.pid for r in rows}) == 2


def test_cell_without_pool_says_how_to_start_one(shell):
    magics = ColossalMagics(shell)  # a second instance that never started a pool
    with pytest.raises(UsageError, match="%colossal start"):
        magics.colossal("", "print(1)")


def test_bad_line_command(shell):
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("colossal", "launch")


TRAINER_CELL = '''
import os, tempfile
import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
group_before = dist.group.WORLD if dist.is_initialized() else None  # None in one process
env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR", "MASTER_PORT")}


class Rows(torch.utils.data.Dataset):  # four equal rows: each step is all four, in any order
    def __init__(self):
        self.ids = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_losses(per_device):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=per_device,
                             max_steps=5, learning_rate=1e-2, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    return args.world_size, [h["loss"] for h in trainer.state.log_history if "loss" in h]


trainer_world, losses = trainer_losses(per_device=2)

from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
mine = torch.tensor([float(rank)])
accelerate_seen = (accelerator.num_processes, accelerator.process_index,
                   accelerator.gather(mine).tolist())
same_group = dist.group.WORLD is group_before
'''


def test_hf_trainer_and_accelerate_in_a_cell_use_the_pools_group(shell):
    """Code written for torchrun runs unchanged in a cell: every rank exports torchrun's
    variables, so HF ``Trainer`` sees world_size 2 and trains as DDP on the pool's group (its
    five losses equal one process with the whole batch, 1e-4), ``accelerate`` counts the pool's
    processes and gathers over them, and neither creates a second default group."""
    cell(shell, "--pull env,trainer_world,losses,accelerate_seen,same_group", TRAINER_CELL)
    ns = shell.user_ns
    env = ns["env"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0", env
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] and env["MASTER_PORT"], env
    assert ns["trainer_world"] == 2 and ns["same_group"]
    assert ns["accelerate_seen"] == (2, 0, [0.0, 1.0]), ns["accelerate_seen"]
    # the same model, data and steps in this process, with both ranks' rows in one batch
    namespace: dict = {"rank": 0}
    code = TRAINER_CELL.split("trainer_world, losses =")[0]
    saved = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        exec(code, namespace)  # noqa: S102  the cell's own definitions
        world, want = namespace["trainer_losses"](per_device=4)
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    assert world == 1 and len(want) == len(ns["losses"]) == 5
    assert max(abs(a - b) / b for a, b in zip(ns["losses"], want)) < 1e-4, (ns["losses"], want)


def _as_terminal(text: str) -> list[str]:
    """The lines a terminal (or Jupyter's output area) shows: each after its last ``\\r``."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def test_a_progress_bar_redrawn_with_carriage_returns_reaches_the_cell_whole(shell, capsys):
    """A rank redrawing one line (tqdm's text bar) is shown as its latest drawing: ipyparallel
    stores the line rewritten, and the cell gets each redraw after a ``\\r``."""
    cell(shell, "", "import sys, time\nfor i in range(5):\n"
                    "    sys.stderr.write(f'\\rstep {i}/4 ' + '#' * i)\n"
                    "    sys.stderr.flush()\n    time.sleep(0.3)\nsys.stderr.write('\\ndone\\n')")
    shown = _as_terminal(capsys.readouterr().err)
    assert shown[:2] == ["step 4/4 ####", "done"], shown


NOBLOCK_TRAINING = """
import time
import torch
from kernels_runtime import ParallelContext, parallelize, train_step

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         ctx=ParallelContext.build(plan, comm), verbose=False)
loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())
ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(rank))
steps = 0
for step in range(STEPS):
    train_step(model, opt, [(ids, ids)], loss_fn)
    steps += 1
    time.sleep(0.2)
"""


def test_noblock_returns_at_once_trains_on_and_hands_back_its_pulls(shell):
    """``--noblock`` returns a handle while the ranks train; the next cell runs meanwhile, the
    dashboard's history gains points, ``wait()`` gives the pulled values; ``interrupt()``
    stops a second run early and the pool runs cells again."""
    from workbench.cells.background import BackgroundCell

    shell.user_ns["STEPS"] = 15
    handle = cell(shell, '--plan "dp=2" --noblock --push STEPS --pull steps', NOBLOCK_TRAINING)
    assert isinstance(handle, BackgroundCell) and not handle.ready()
    assert shell.run_cell("meanwhile = 6 * 7").success and shell.user_ns["meanwhile"] == 42
    with pytest.raises(UsageError, match="a --noblock cell still runs"):
        cell(shell, "", "print('second')")
    assert not handle.ready()  # the notebook went on while the ranks trained
    assert handle.wait(120) == {"steps": 15} and shell.user_ns["steps"] == 15
    assert len(handle.history.points) >= 2  # the live dashboard kept ingesting

    shell.user_ns["STEPS"] = 1000
    stopped = cell(shell, '--plan "dp=2" --noblock --push STEPS', NOBLOCK_TRAINING)
    time.sleep(3)
    stopped.interrupt()
    with pytest.raises(KeyboardInterrupt):
        stopped.wait(60)
    cell(shell, "--pull steps", "pass")
    assert 0 < shell.user_ns["steps"] < 1000  # interrupted midway
    cell(shell, "--pull after", "after = 1")  # the pool runs cells again
    assert shell.user_ns["after"] == 1
