"""fp16 with dynamic loss scaling survives an injected overflow, on 2 real gloo ranks.

The overflow is put into one gradient element before reduction, so after ZeRO's reduce-scatter
only the rank owning that element sees it: every rank must still agree to skip the step.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import models as dm
from helpers.distributed import context

OVERFLOW_STEP = 3


def _run_fp16(rank: int, world: int, zero: int) -> dict:
    from kernels_runtime import parallelize, train_step

    model = dm.make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=dm.LR)
    model, opt = parallelize(model, opt, ctx=context(f"dp={world} zero={zero} fp16"))
    inject = {"on": False}
    first = next(model.parameters())
    if zero < 3:  # poison one element of one gradient before it is reduced
        first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf)
                            if inject["on"] else g)
    scales, stepped, losses, before, after = [], [], [], None, None
    for step in range(12):
        inject["on"] = step == OVERFLOW_STEP
        mbs = dm.local_microbatches(step, opt.ctx.dp_rank, opt.ctx.dp_size, 1)
        loss_fn = dm.hf_loss
        if zero == 3 and step == OVERFLOW_STEP and rank == 1:
            def loss_fn(m, b):
                return dm.hf_loss(m, b) * math.inf
        if step == OVERFLOW_STEP:
            before = dm.full_parameters(model)
        result = train_step(model, opt, mbs, loss_fn=loss_fn)
        if step == OVERFLOW_STEP:
            after = dm.full_parameters(model)
        scales.append(opt.scaler.scale)
        stepped.append(result.stepped)
        losses.append(result.loss)
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    return {"scales": scales, "stepped": stepped, "losses": losses, "unchanged": unchanged,
            "skipped": opt.steps_skipped}


@pytest.mark.parametrize("zero", [1, 3])
def test_fp16_overflow_is_skipped_on_every_rank_and_training_recovers(ranks, zero):
    results = ranks(2).run(_run_fp16, zero, timeout_s=300)
    for rank, r in enumerate(results):
        label = f"zero={zero} rank {rank}"
        assert r["stepped"][OVERFLOW_STEP] is False, label
        assert r["unchanged"], f"{label}: parameters changed on a skipped step"
        assert r["scales"][OVERFLOW_STEP] == r["scales"][OVERFLOW_STEP - 1] / 2, label
        assert all(r["stepped"][s] for s in range(len(r["stepped"])) if s != OVERFLOW_STEP)
        later = r["losses"][OVERFLOW_STEP + 1:]
        assert all(math.isfinite(x) for x in later), label
        assert later[-1] < r["losses"][0] * 0.9, f"{label}: did not recover"
    assert results[0]["stepped"] == results[1]["stepped"]
