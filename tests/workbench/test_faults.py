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
    assert "rank 0 process died" not in reply.evalue

    dead = kernel.run("%%colossal\nprint('hi')")
    assert dead.status == "error" and "restart" in "\n".join(dead.traceback), dead.traceback

    kernel.run_ok("%colossal restart", timeout_s=180)
    ok = kernel.run_ok(
        "%%colossal --output all\nimport torch\nt = torch.ones(2) * (rank + 1)\n"
        "comm.all_reduce(t)\nprint('sum', t.tolist())"
    )
    assert "[rank 0] sum [3.0, 3.0]" in ok.text and "[rank 1] sum [3.0, 3.0]" in ok.text


def test_interrupt_during_sleep_reaches_notebook_and_pool_stays_usable(kernel):
    msg_id = kernel.submit("%%colossal\nimport time\ntime.sleep(120)\n")
    time.sleep(2.0)  # both ranks are now sleeping
    t0 = time.monotonic()
    kernel.interrupt()
    reply = kernel.collect(msg_id, timeout_s=30)
    assert reply.status == "error" and reply.ename == "KeyboardInterrupt"
    assert reply.received_at - t0 < 3.0, f"took {reply.received_at - t0:.2f} s"

    ok = kernel.run_ok(
        "%%colossal --output all\nimport torch\nt = torch.ones(1) * (rank + 1)\n"
        "comm.all_reduce(t)\nprint('after interrupt', t.item())"
    )
    assert "[rank 0] after interrupt 3.0" in ok.text
    assert "[rank 1] after interrupt 3.0" in ok.text
