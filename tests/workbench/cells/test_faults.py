"""Faults met from a real notebook kernel: a rank killed mid-cell, and the stop button.

Each test drives a real Jupyter kernel running the workbench with a real 2-rank pool of
ipyparallel engines on gloo.
"""

from __future__ import annotations

import time

import pytest

from helpers.kernel_session import KernelSession

pytestmark = pytest.mark.engines


@pytest.fixture
def kernel():
    k = KernelSession()
    k.run_ok("%load_ext workbench\n%colossal start -n 2 --timeout 10", timeout_s=180)
    yield k
    k.close()


def test_sigkill_of_one_rank_is_reported_by_rank_and_restart_recovers(kernel):
    msg_id = kernel.submit(
        "%%colossal\n"
        "import os, signal, time\n"
        "if rank == 1:\n"
        "    time.sleep(1.0)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    reply = kernel.collect(msg_id, timeout_s=60)
    assert reply.status == "error"
    assert reply.received_at - t0 < 10, f"took {reply.received_at - t0:.1f} s"
    assert reply.ename == "RankFailureError"
    assert "rank 1" in reply.evalue and "SIGKILL" in reply.evalue, reply.evalue
    # rank 0 was only waiting: it must not be blamed as the cause
    assert "rank 0 on host" not in reply.evalue

    dead = kernel.run("%%colossal\nprint('hi')")
    assert dead.status == "error" and "restart" in "\n".join(dead.traceback), dead.traceback

    kernel.run_ok("%colossal restart", timeout_s=180)
    ok = kernel.run_ok(
        "%%colossal --output all\nimport torch\nt = torch.ones(2) * (rank + 1)\n"
        "comm.all_reduce(t)\nprint('sum', t.tolist())"
    )
    assert "[rank 0] sum [3.0, 3.0]" in ok.text and "[rank 1] sum [3.0, 3.0]" in ok.text


def test_interrupt_during_sleep_reaches_notebook_and_pool_stays_usable(kernel):
    msg_id = kernel.submit("%%colossal\nimport time, torch\ncomm.all_reduce(torch.ones(1))\n"
                           "print('both ranks past the all-reduce', flush=True)\n"
                           "time.sleep(120)\n")
    kernel.wait_for_output(msg_id, "both ranks past the all-reduce")  # now each sleeps
    t0 = time.monotonic()
    kernel.interrupt()
    reply = kernel.collect(msg_id, timeout_s=30)
    assert reply.status == "error" and reply.ename == "KeyboardInterrupt"
    # the promise: an interrupt stops a cell promptly (measured well under 1 s)
    assert reply.received_at - t0 < 5.0, f"took {reply.received_at - t0:.2f} s"

    ok = kernel.run_ok(
        "%%colossal --output all\nimport torch\nt = torch.ones(1) * (rank + 1)\n"
        "comm.all_reduce(t)\nprint('after interrupt', t.item())"
    )
    assert "[rank 0] after interrupt 3.0" in ok.text
    assert "[rank 1] after interrupt 3.0" in ok.text


PIPELINE_CELL = """%%colossal --plan "pp=2 mb=4"
import time, torch
from torch import nn
from kernels_runtime import parallelize, train_step
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, verbose=False)
def slow_loss(model, batch):
    time.sleep(0.1)  # a step lasts ~1 s, so the interrupt lands inside one
    return nn.functional.mse_loss(model(batch[0]), batch[1])
x, y = torch.randn(8, 4), torch.randn(8, 1)
for step in range(1000):
    train_step(model, opt, list(zip(x.chunk(4), y.chunk(4))), slow_loss)
    if step == 1:
        print("stepping", flush=True)
"""


def test_interrupt_during_a_pipeline_step_stops_every_stage_at_the_same_step(kernel):
    msg_id = kernel.submit(PIPELINE_CELL)
    kernel.wait_for_output(msg_id, "stepping")  # parallelized and two steps in
    time.sleep(1.0)
    kernel.interrupt()
    reply = kernel.collect(msg_id, timeout_s=60)
    assert reply.status == "error" and reply.ename == "KeyboardInterrupt", reply.evalue

    steps = kernel.run_ok(
        "%%colossal --output all\n"
        "print('stopped at', model.parallel_state.schedule.steps, "
        "[p.detach().sum().item() for p in model.parameters()][:1])")
    lines = [line for line in steps.text.splitlines() if "stopped at" in line]
    assert len(lines) == 2, steps.text
    counts = {line.split("stopped at")[1].split("[")[0].strip() for line in lines}
    assert len(counts) == 1 and int(counts.pop()) > 0, steps.text
    again = kernel.run_ok(PIPELINE_CELL.replace("range(1000)", "range(2)")
                          + "print('trained again', rank)\n")
    assert "trained again 0" in again.text


SPILLING_CELL = (
    "%%colossal --output all\n"
    "import torch, transformers\n"
    "from kernels_runtime import ParallelContext, parallelize, train_step\n"
    "torch.manual_seed(0)\n"
    "m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4,"
    " vocab_size=64, n_positions=16))\n"
    "ctx = ParallelContext.build('dp=2 zero=2 offload=static offload_optim=1 host_mem=0', comm)\n"
    "m, opt = parallelize(m, torch.optim.AdamW(m.parameters()), ctx=ctx, verbose=False)\n"
    "ids = torch.randint(0, 64, (2, 16))\n"
    "train_step(m, opt, [(ids, ids)])\n"
    "print('spill', opt.sync.spill_folder.parent)\n"
)


def test_restart_removes_the_spill_folders_of_killed_ranks_only(kernel, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    out = kernel.run_ok(SPILLING_CELL, timeout_s=120).text
    folders = {int(line.split("]")[0].split()[-1]): Path(line.split("spill ")[1].strip())
               for line in out.splitlines() if " spill " in line}
    assert set(folders) == {0, 1} and all(f.is_dir() for f in folders.values()), out
    root = folders[0].parent.parent
    # another pool on this host, alive, with a folder under the same root
    other = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; from pathlib import Path; "
                              "from kernels_runtime.memory.spill import SpillDir; "
                              f"d = SpillDir(Path({str(root)!r}), 0, pool='another-pool'); "
                              "print(d.path, flush=True); time.sleep(120)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        other_folder = Path(other.stdout.readline().strip())
        assert other_folder.is_dir()
        reply = kernel.run("%%colossal\nimport os, signal\n"
                           "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                           "import time; time.sleep(30)\n", timeout_s=60)
        assert reply.status == "error" and "rank 1" in reply.evalue, reply.evalue
        assert folders[1].is_dir()  # a SIGKILLed rank cannot clean up after itself
        kernel.run_ok("%colossal restart", timeout_s=180)
        assert not folders[1].exists(), "the killed rank's spill folder is still there"
        assert other_folder.is_dir(), "another running pool's spill folder was removed"
    finally:
        other.kill()
