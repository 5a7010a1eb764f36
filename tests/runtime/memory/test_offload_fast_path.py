"""Automatic placement when everything fits costs what training without offload costs, and only
then: the per-saved-tensor count of activations is skipped once a measured step left room to
spare, and resumed as soon as that room is not there (evictions counted, the budget kept from
the next step on, losses unchanged); freed gradient buffers are reused only in room nobody
needs (dropped before anything is evicted)."""

from __future__ import annotations

import torch

from helpers import models as dm
from helpers.distributed import context
from helpers.model_state import activation_bytes

SMALL, LARGE = 8, 2  # micro-batches per step: 1 row each, then 4 rows each (4x activations)
SCHEDULE = [SMALL] * 4 + [LARGE] * 3


def _train(plan: str) -> tuple[list[float], list[dict], torch.nn.Module]:
    from kernels_runtime import parallelize, train_step

    ctx = context(plan)
    model = dm.make_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=dm.LR, weight_decay=dm.WEIGHT_DECAY)
    model, opt = parallelize(model, opt, ctx=ctx, verbose=False)
    losses, steps = [], []
    for step, accum in enumerate(SCHEDULE):
        mbs = dm.local_microbatches(step, ctx.dp_rank, ctx.dp_size, accum)
        losses.append(train_step(model, opt, mbs, loss_fn=dm.hf_loss).loss)
        if hasattr(opt.sync, "activations"):
            steps.append({**opt.sync.last_step, "unmeasured": opt.sync.activations.unmeasured})
    return losses, steps, model


def _fast_path_then_tight(rank: int, world: int) -> dict:
    # a first run with room for anything tells this model's device peak and activations
    _, probe, _ = _train("dp=2 zero=2 offload=auto device_mem=1GiB")
    peak, small = probe[1]["device_peak"], probe[1]["activations"]
    from kernels_runtime.memory.activation_reserve import ROOM_FACTOR

    # room for the small micro-batches' activations twice over, not for the large ones'
    budget = peak + ROOM_FACTOR * small + small // 2
    ref_losses, _, _ = _train("dp=2 zero=2")
    losses, steps, _ = _train(f"dp=2 zero=2 offload=auto device_mem={budget}")
    return {"budget": budget, "small": small, "large": activation_bytes(rank, world, LARGE),
            "steps": steps, "loss_rel": max(abs(a - b) / abs(b)
                                            for a, b in zip(losses, ref_losses))}


def test_the_fast_path_runs_while_there_is_room_and_is_left_when_it_is_gone(ranks):
    for rank, out in enumerate(ranks(2).run(_fast_path_then_tight, timeout_s=300)):
        steps = out["steps"]
        unmeasured = [s["unmeasured"] for s in steps]
        fast = [b - a for a, b in zip([0, *unmeasured], unmeasured)]
        print(f"rank {rank}: budget {out['budget']} B, micro-batches not counted per step "
              f"{fast}, evictions {[s['evictions'] for s in steps]}, reserved "
              f"{[s['activations'] for s in steps]}")
        assert fast[0] == 0, "the first step is measured"
        assert fast[1:4] == [SMALL] * 3, f"room to spare: every micro-batch uncounted {fast}"
        assert all(s["evictions"] == 0 for s in steps[:4]), steps[:4]
        # the first large micro-batch starts uncounted, outgrows the one measured, and the
        # reserve grows at once: model state is evicted for it; the rest are counted
        assert fast[4] == 1 and steps[4]["evictions"] > 0, (fast, steps[4])
        assert fast[5:] == [0, 0] and all(s["evictions"] > 0 for s in steps[5:]), fast
        for s in steps[5:]:
            assert s["activations"] == out["large"], (s["activations"], out["large"])
            assert s["device_total_peak"] <= out["budget"], (s, out["budget"])
        assert out["loss_rel"] <= 1e-6, out["loss_rel"]


def test_recycled_buffers_go_before_anything_is_evicted():
    from kernels_runtime.comm.accelerator import Accelerator
    from kernels_runtime.memory.placement import Placer, Trace
    from kernels_runtime.memory.tiers import Tier, TierStore

    store = TierStore(Accelerator.host())
    store.recycle = True
    placer = Placer(store, "auto", device_budget=4000, host_budget=None, predicted=Trace())
    state = store.allocate("state", 500, torch.float32, Tier.DEVICE)  # 2000 B
    placer.register(state)
    grad = store.adopt("grad", torch.ones(250), Tier.DEVICE)  # 1000 B
    store.free(grad, recycle=True)
    assert store.spare_bytes == 1000 and store.used[Tier.DEVICE] == 3000
    again = store.device_zeros(250, torch.float32)  # the same memory, zero-filled
    assert store.spare_bytes == 0 and bool((again == 0).all())
    store.release_device_buffer(again)
    placer.make_room(Tier.DEVICE, 1500)  # fits once the spare is gone: nothing evicted
    assert store.spare_bytes == 0 and store.evictions == 0 and state.tier == Tier.DEVICE
    store.release_device_buffer(torch.empty(250))
    placer.make_room(Tier.DEVICE, 2500)  # needs the spare's room and the state's
    assert store.spare_bytes == 0 and store.evictions == 1 and state.tier == Tier.HOST
    kept = TierStore(Accelerator.host())  # not recycling (a GPU, static placement)
    kept.release_device_buffer(torch.empty(250))
    assert kept.spare_bytes == 0
