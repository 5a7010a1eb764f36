"""A disk chunk's optimizer step runs at the chunk's next use, and nobody can tell but the clock:
with a learning rate changed between ``step()`` and the next forward, gradient clipping, an
evaluation forward in between and the optimizer's scalar state read right after ``step()``,
training under ``offload=static`` on the disk tier gives the losses and parameters of training
without offload, while the steps were in fact pending after every ``step()``."""

from __future__ import annotations

import torch

from helpers import models as dm
from helpers.distributed import context
from helpers.model_state import state_parameters

DISK = "offload=static offload_params=1 offload_grads=1 offload_optim=1 host_mem=0"
STEPS = 6


def _train(plan: str) -> dict:
    from kernels_runtime import parallelize, train_step

    ctx = context(plan)
    model = dm.make_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=dm.LR, weight_decay=dm.WEIGHT_DECAY)
    model, opt = parallelize(model, opt, ctx=ctx, verbose=False, max_grad_norm=0.5)
    losses, evals, pending, steps = [], [], [], []
    for step in range(STEPS):
        mbs = dm.local_microbatches(step, ctx.dp_rank, ctx.dp_size, 2)
        losses.append(train_step(model, opt, mbs, loss_fn=dm.hf_loss).loss)
        pending.append(len(getattr(opt.sync, "_deferred", [])))
        if step == 2:  # the step counters as a checkpoint would save them, right after step()
            steps.append(opt.scalar_state()["groups"])
        for group in opt.param_groups:  # a schedule stepping between step() and the forward
            group["lr"] *= 0.5
        if step % 2:
            with torch.no_grad():  # an evaluation forward sees the parameters stepped
                evals.append(dm.hf_loss(model, mbs[0]).item())
    return {"losses": losses, "evals": evals, "pending": pending, "steps": steps,
            "deferred": getattr(opt.sync, "deferred_steps", 0),
            "params": state_parameters(model)}


def _compare(rank: int, world: int) -> dict:
    ref, got = _train("dp=2 zero=2"), _train(f"dp=2 zero=2 {DISK}")
    rel = max(((got["params"][n] - p).norm() / p.norm().clamp_min(1e-12)).item()
              for n, p in ref["params"].items())
    return {"ref": ref, "got": got, "param_rel": rel}


def test_deferred_disk_steps_train_like_steps_taken_at_once(ranks):
    for out in ranks(2).run(_compare, timeout_s=300):
        ref, got = out["ref"], out["got"]
        print(f"pending chunk steps after each step() {got['pending']}, deferred "
              f"{got['deferred']}, param rel {out['param_rel']:.1e}")
        assert all(n > 0 for n in got["pending"]), got["pending"]  # really deferred
        assert got["deferred"] >= (STEPS - 1) * got["pending"][0]
        for a, b in zip(got["losses"] + got["evals"], ref["losses"] + ref["evals"]):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], ref["losses"])
        assert got["steps"] == ref["steps"], (got["steps"], ref["steps"])
        assert out["param_rel"] <= 1e-5, out["param_rel"]
