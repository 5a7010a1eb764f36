"""An offloaded run's checkpoint, and what goes wrong with the spill directory.

What is protected: a checkpoint saved while parameters, gradients and optimizer states live on
disk resumes without offload (flat-bucket ZeRO-2 and FSDP2 ZeRO-3) with the uninterrupted
losses (1e-6), and one saved without offload resumes under offload; a spill directory on tmpfs
or one that cannot be created refuses the plan before the model changes, naming the
directory; a spill that hits the file-size limit is an error naming the directory and the
limit, and every payload it had evicted is still complete (in memory, or in a file whose size
is its own).
"""

from __future__ import annotations

import torch

from helpers import models as dm
from helpers.distributed import context

DISK = "offload=static offload_params=1 offload_grads=1 offload_optim=1 host_mem=0"


def _steps(plan: str, root: str, save_at: int | None, resume: bool) -> list[float]:
    from kernels_runtime import load, parallelize, save, train_step

    ctx = context(plan)
    model = dm.make_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=dm.LR, weight_decay=dm.WEIGHT_DECAY)
    model, opt = parallelize(model, opt, ctx=ctx, verbose=False)
    start = load(root, model, opt)["step"] if resume else 0
    losses = []
    for step in range(start, 8):
        if step == save_at:
            save(root, model, opt, step=step)
        mbs = dm.local_microbatches(step, ctx.dp_rank, ctx.dp_size, 1)
        losses.append(train_step(model, opt, mbs, loss_fn=dm.hf_loss).loss)
    return losses


def _save(rank: int, world: int, plan: str, root: str) -> list[float]:
    return _steps(plan, root, save_at=4, resume=False)


def _resume(rank: int, world: int, plan: str, root: str) -> list[float]:
    return _steps(plan, root, save_at=None, resume=True)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_an_offloaded_checkpoint_resumes_without_offload_and_back(ranks, tmp_path):
    saved = str(tmp_path / "offloaded")
    uninterrupted = ranks(2).run(_save, f"dp=2 zero=3 {DISK}", saved, timeout_s=300)[0]
    for plan in ("dp=2 zero=2", "dp=2 zero=3"):
        resumed = ranks(2).run(_resume, plan, saved, timeout_s=300)[0]
        assert _rel(resumed, uninterrupted[4:]) < 1e-6, (plan, resumed, uninterrupted[4:])
    plain = str(tmp_path / "plain")
    uninterrupted = ranks(2).run(_save, "dp=2 zero=2", plain, timeout_s=300)[0]
    # 160 KiB of the device budget for model state beside a micro-batch's ~1 MiB of activations
    resumed = ranks(2).run(_resume, "dp=2 zero=2 offload=auto device_mem=1184KiB host_mem=64KiB",
                           plain, timeout_s=300)[0]
    assert _rel(resumed, uninterrupted[4:]) < 1e-6, (resumed, uninterrupted[4:])


def _bad_directories(rank: int, world: int, tmp: str) -> dict:
    from kernels_runtime import PlanError, parallelize

    out = {}
    (tmp_file := __import__("pathlib").Path(tmp) / "a-file").write_text("x")
    for key, where in {"tmpfs": "/dev/shm/workbench-test-spill",
                       "uncreatable": str(tmp_file / "spill")}.items():
        model = dm.make_model("gpt2")
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        try:
            parallelize(model, torch.optim.AdamW(model.parameters()),
                        ctx=context(f"dp=2 zero=2 {DISK}"), spill_dir=where, verbose=False)
            out[key] = ("no error", False)
        except PlanError as err:
            after = {n: p.data_ptr() for n, p in model.named_parameters()}
            out[key] = (str(err), before == after)
    return out


def test_a_spill_directory_in_memory_or_unwritable_refuses_the_plan(ranks, tmp_path):
    out = ranks(2).run(_bad_directories, str(tmp_path))[0]
    message, untouched = out["tmpfs"]
    assert "/dev/shm/workbench-test-spill" in message and "tmpfs" in message, message
    assert "WORKBENCH_SPILL_DIR" in message and untouched
    message, untouched = out["uncreatable"]
    assert "a-file/spill" in message and "cannot be created" in message, message
    assert untouched


def _file_size_limit(rank: int, world: int, tmp: str) -> dict:
    import resource

    from kernels_runtime import parallelize, train_step
    from kernels_runtime.memory.tiers import Tier

    model = dm.make_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=dm.LR)
    model, opt = parallelize(model, opt, ctx=context(f"dp=2 zero=2 {DISK}"), spill_dir=tmp,
                             verbose=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # smaller than every chunk
    try:
        train_step(model, opt, dm.local_microbatches(0, rank, world, 1), loss_fn=dm.hf_loss)
        error = "no error"
    except OSError as err:
        error = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    sync = opt.sync
    complete = []
    for payload in [*sync.param, *sync.master, *(p for s in sync.states for p in s.values())]:
        if payload.tier == Tier.DISK:
            complete.append(sync.store.disk.nbytes(payload.key) == payload.nbytes)
        else:
            complete.append(payload.handle.numel() == payload.numel)
    return {"error": error, "folder": str(sync.spill_folder), "complete": all(complete)}


def test_a_full_spill_directory_is_an_error_and_loses_nothing(ranks, tmp_path):
    out = ranks(2).run(_file_size_limit, str(tmp_path), timeout_s=300)[0]
    assert out["folder"] in out["error"] and "file-size limit" in out["error"], out
    assert out["complete"], "a payload whose spill failed is neither in memory nor complete"


def _too_small(rank: int, world: int) -> str:
    from kernels_runtime import parallelize

    model = dm.make_model("gpt2")
    try:
        parallelize(model, torch.optim.AdamW(model.parameters()), verbose=False,
                    ctx=context("dp=2 zero=2 offload=auto device_mem=16KiB host_mem=1KiB"))
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_budget_below_one_steps_working_set_fails_before_the_first_step(ranks):
    message = ranks(2).run(_too_small)[0]
    assert message.startswith("BudgetError"), message
    # a GPT-2 block (12.7K parameters, whole, with its fp32 gradient buffer) and one chunk's
    # gradient, master and two Adam states on the host (c_fc.weight, 4096 elements, a chunk
    # of its own under so small a budget: 2048 per rank x 4 tensors x 4 bytes)
    assert "device_mem=16.0 KiB < 99.2 KiB" in message, message
    assert "host_mem=1.00 KiB < 32.0 KiB" in message and "at least the minimum" in message
