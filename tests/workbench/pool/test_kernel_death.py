"""A kernel SIGKILLed while its pool works leaves nothing behind.

Jupyter kills a slow kernel with SIGKILL at shutdown; no ``Pool.stop`` runs then. The pool's
reaper (``workbench.pool.reaper``), the engines' SIGTERM handling and the forked parent's escalation
(``workbench.pool.rank_process``) must still end every process the pool started: the controller, the
forked engine parent, the engines and their nannies, within 30 s, and remove the pool's spill
folders. Each case drives a real Jupyter kernel with a real 2-rank pool on gloo: a dp=2
training cell and a served engine with 8 streams in flight, each on a local pool and on a Slurm
pool (real daemons; there the job must also leave ``squeue``, and the served model is the real
SmolLM2, built as ``workbench serve --model`` builds it). The processes are counted from the
kernel's process tree (and the job's, on Slurm) before the kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from helpers.kernel_session import KernelSession

pytestmark = [pytest.mark.engines, pytest.mark.full]

GONE_WITHIN_S = 30.0

# a dp=2 training loop that never ends by itself; each rank also claims its spill folder,
# as offloading to disk does
TRAINING_CELL = """%%colossal --plan "dp=2"
import os, time, torch
from torch import nn
from kernels_runtime import parallelize, train_step
from kernels_runtime.memory.spill import SpillDir, spill_root
spill = SpillDir(spill_root(), rank)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, verbose=False)
def slow_loss(model, batch):
    time.sleep(0.05)
    return nn.functional.mse_loss(model(batch[0]), batch[1])
x, y = torch.randn(8, 4), torch.randn(8, 1)
for step in range(100000):
    train_step(model, opt, [(x, y)], slow_loss)
    if step == 1:
        print("stepping", spill.path, flush=True)
"""


# a small random model with room for long answers, one replica per rank
SERVE_BUILD = """%%colossal
import sys, torch; sys.path.insert(0, 'tests')
from helpers import inference as inf
from transformers import GPT2Config, GPT2LMHeadModel
from kernels_runtime.data.corpus import ByteTokenizer
from kernels_runtime.inference import Engine
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=inf.VOCAB, n_positions=2048, n_embd=64, n_layer=2,
                                   n_head=4)).eval()
engine = Engine(model, 'dp=2', comm=comm, tokenizer=ByteTokenizer(), kv_mem='16MiB',
                verbose=False)
"""
STREAMS = 8


def _pool_tree(kernel_pid: int) -> list[psutil.Process]:
    """Every process under the kernel (controller, forked parent, engines, nannies...)."""
    return psutil.Process(kernel_pid).children(recursive=True)


def _still_running(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            continue
    return alive


def _kill_and_wait(kernel: KernelSession, tree: list[psutil.Process]) -> list[str]:
    kernel_pid = kernel.km.provisioner.process.pid
    os.kill(kernel_pid, signal.SIGKILL)
    deadline = time.monotonic() + GONE_WITHIN_S
    t0 = time.monotonic()
    while (alive := _still_running(tree)) and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"{len(tree)} processes of the pool, {len(alive)} left "
          f"{time.monotonic() - t0:.1f} s after the kernel's SIGKILL")
    return alive


def _cleanup(kernel: KernelSession, tree: list[psutil.Process]) -> None:
    for p in tree:  # never leave a failed case's processes to the next test
        with contextlib.suppress(psutil.Error):
            p.kill()
    kernel.kc.stop_channels()
    kernel.km.shutdown_kernel(now=True)


def test_kernel_killed_during_a_dp2_training_cell_leaves_no_process_or_spill(tmp_path):
    spill_root = tmp_path / "spill"
    kernel = KernelSession(env={"WORKBENCH_SPILL_DIR": str(spill_root)})
    tree: list[psutil.Process] = []
    try:
        kernel.run_ok("%load_ext workbench\n%colossal start -n 2 --timeout 10", timeout_s=180)
        msg_id = kernel.submit(TRAINING_CELL)
        kernel.wait_for_output(msg_id, "stepping", timeout_s=120)
        tree = _pool_tree(kernel.km.provisioner.process.pid)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "ipcontroller" in names or "ipyparallel.controller" in names, names
        assert "--workbench-fork=2" in names, names
        folders = [f for f in spill_root.glob("pool-*/rank*") if f.is_dir()]
        assert len(folders) == 2, list(spill_root.rglob("*"))

        alive = _kill_and_wait(kernel, tree)
        assert not alive, f"still running {GONE_WITHIN_S} s after the kernel died: {alive}"
        left = [str(p) for p in spill_root.glob("pool-*")]
        assert not left, f"spill folders left: {left}"
    finally:
        _cleanup(kernel, tree)


def _stream(url: str, body: dict, key: str, started: threading.Semaphore) -> None:
    """One streamed completion, read until the server goes away."""
    with contextlib.suppress(httpx.HTTPError), httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60,
            headers={"Authorization": f"Bearer {key}"}) as response:
        first = True
        for _ in response.iter_lines():
            if first:
                started.release()
                first = False


def _serve_streams(kernel: KernelSession, build_cell: str, body: dict) -> list[threading.Thread]:
    """Build ``engine`` on the ranks (each also claiming its spill folder), serve it with
    ``%colossal serve`` and return once ``STREAMS`` streamed completions are answering."""
    from workbench.serving.server import free_port

    kernel.run_ok(build_cell + "from kernels_runtime.memory.spill import SpillDir, "
                  "spill_root\nspill = SpillDir(spill_root(), rank)\n", timeout_s=300)
    port = free_port()
    kernel.run_ok(f"%colossal serve engine --port {port} --no-dashboard", timeout_s=120)
    key = kernel.run_ok(f"from workbench.serving import api_key\nprint(api_key({port}))")
    url = f"http://127.0.0.1:{port}"
    started = threading.Semaphore(0)
    clients = [threading.Thread(target=_stream, args=(url, body, key.text.strip(), started),
                                daemon=True) for _ in range(STREAMS)]
    for c in clients:
        c.start()
    for _ in range(STREAMS):
        assert started.acquire(timeout=120), "a stream never started"
    return clients


def test_kernel_killed_while_serving_streams_leaves_no_process_or_spill(tmp_path):
    spill_root = tmp_path / "spill"
    kernel = KernelSession(env={"WORKBENCH_SPILL_DIR": str(spill_root)})
    tree: list[psutil.Process] = []
    try:
        kernel.run_ok("%load_ext workbench\n%colossal start -n 2 --timeout 10", timeout_s=180)
        body = {"model": "engine", "prompt": "def f(x", "max_tokens": 1500, "temperature": 0}
        clients = _serve_streams(kernel, SERVE_BUILD, body)
        tree = _pool_tree(kernel.km.provisioner.process.pid)
        assert "--workbench-fork=2" in " ".join(" ".join(p.cmdline()) for p in tree)
        assert len([f for f in spill_root.glob("pool-*/rank*") if f.is_dir()]) == 2

        alive = _kill_and_wait(kernel, tree)
        assert not alive, f"still running {GONE_WITHIN_S} s after the kernel died: {alive}"
        left = [str(p) for p in spill_root.glob("pool-*")]
        assert not left, f"spill folders left: {left}"
        for c in clients:
            c.join(timeout=10)
    finally:
        _cleanup(kernel, tree)


def _job_processes(job: str) -> list[psutil.Process]:
    """The processes Slurm runs for ``job`` on this host (srun's tasks: the engines)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("SLURM_JOB_ID") == job:
                found.append(p)
    return found


def _start_slurm_pool(kernel: KernelSession) -> str:
    """A 2-rank pool whose engines are one Slurm job; returns the job id."""
    kernel.run_ok("%load_ext workbench\n%colossal start -n 2 --launcher slurm "
                  "--controller-ip 127.0.0.1 --timeout 10", timeout_s=180)
    jobs = kernel.run_ok("from workbench.magics import active_pool\n"
                         "print(*active_pool(get_ipython()).slurm_jobs())").text.split()
    assert len(jobs) == 1, jobs
    return jobs[0]


def _slurm_tree(kernel: KernelSession, job: str) -> list[psutil.Process]:
    """The kernel's descendants and the job's processes (2 engines among them)."""
    engines = _job_processes(job)
    ranks = [p for p in engines
             if p.name() != "srun" and "workbench.pool.rank_process" in p.cmdline()]
    assert len(ranks) == 2, [p.cmdline() for p in engines]
    return _pool_tree(kernel.km.provisioner.process.pid) + engines


def _assert_job_and_spill_gone(slurm, job: str, spill_root) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (queued := slurm.run("squeue", "-h", "-j", job, check=False).strip()) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not queued, f"the job is still in squeue: {queued}"
    deadline = time.monotonic() + 10  # the reaper removes them once the ranks ended
    while (left := [str(p) for p in spill_root.glob("pool-*")]) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"spill folders left: {left}"


def test_kernel_killed_during_training_on_a_slurm_pool_cancels_the_job(tmp_path, slurm):
    spill_root = tmp_path / "spill"
    kernel = KernelSession(env={"WORKBENCH_SPILL_DIR": str(spill_root), **slurm.env()})
    tree: list[psutil.Process] = []
    try:
        job = _start_slurm_pool(kernel)
        msg_id = kernel.submit(TRAINING_CELL)
        kernel.wait_for_output(msg_id, "stepping", timeout_s=120)
        tree = _slurm_tree(kernel, job)
        assert len([f for f in spill_root.glob("pool-*/rank*") if f.is_dir()]) == 2

        alive = _kill_and_wait(kernel, tree)
        assert not alive, f"still running {GONE_WITHIN_S} s after the kernel died: {alive}"
        _assert_job_and_spill_gone(slurm, job, spill_root)
    finally:
        _cleanup(kernel, tree)


def test_kernel_killed_while_serving_smollm2_on_a_slurm_pool_cancels_the_job(
        tmp_path, slurm, smollm2):
    from workbench.serving.cli import BUILD

    spill_root = tmp_path / "spill"
    kernel = KernelSession(env={"WORKBENCH_SPILL_DIR": str(spill_root), **slurm.env()})
    tree: list[psutil.Process] = []
    try:
        job = _start_slurm_pool(kernel)
        # the real model, one replica per rank, as ``workbench serve --model`` builds it
        build = "%%colossal\n" + BUILD.format(folder=str(smollm2.folder), plan="dp=2",
                                              kv_mem="128MiB", adapters={}, pack_weights=False)
        # ignore_eos: every answer runs its whole budget, so all 8 are in flight at the kill
        body = {"model": "engine", "prompt": "The history of Paris", "max_tokens": 300,
                "temperature": 0, "ignore_eos": True}
        clients = _serve_streams(kernel, build, body)
        tree = _slurm_tree(kernel, job)
        assert len([f for f in spill_root.glob("pool-*/rank*") if f.is_dir()]) == 2

        alive = _kill_and_wait(kernel, tree)
        assert not alive, f"still running {GONE_WITHIN_S} s after the kernel died: {alive}"
        _assert_job_and_spill_gone(slurm, job, spill_root)
        for c in clients:
            c.join(timeout=10)
    finally:
        _cleanup(kernel, tree)
