"""``ep`` with the model state offloaded to host or disk trains like one process (issue 29).

What is protected: under ``ep=2 offload=static`` the offload applier lays out two chunk states
(``memory/expert_chunks.py``): non-expert parameters reduced and sharded over dp, expert slices
over their expert-data group, both placed off the device by the plan's shares. A tiny Mixtral (4
experts, top-2, 2 layers; ``test_expert_parallelize.py``'s model and padded batch) on 2 gloo
ranks, SGD with momentum (a state per element, offloaded too), gives the single-process model's
5 steps: losses (language-model plus load-balancing loss) and auxiliary losses, first-step
gradients of every parameter (read from the chunks' reduced gradient shards, all-gathered over
each sync's own group: the part of the reference this rank holds), the global gradient norm,
and the final parameters as a checkpoint writes them, all within 1e-5 relative L2; and model
state really lived on the host (or, beyond ``host_mem=0``, on disk). Zero 2 and 3 on 2 ranks in
the fast tier (there the expert-data group is one rank); on 4 ranks (expert-data groups of 2,
whose collectives then run) in the full tier, as is ep=2 beside tp=2. Plans: ``offload=auto``,
``device_mem`` and tp beside offload validate under ep (automatic placement under a budget:
``test_expert_offload_auto.py``), a pipeline beside offload is refused; ``parallelize_model``
without an optimizer is refused, saying what to use instead.
"""

from __future__ import annotations

import pytest
import torch
from test_expert_parallelize import (
    BATCH,
    LR,
    STEPS,
    _assert_close,
    _backward_both,
    _local_part,
    _model,
    _rel,
    _saved,
)

OFFLOAD = "offload=static offload_params=1 offload_grads=1 offload_optim=1"


def _chunk_grads(sync) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient from one chunk sync's gradient shards, all-gathered
    over that sync's own data-parallel group (dp, or expert-dp for the experts)."""
    ctx, out = sync.ctx, {}
    for c in sync.chunks:
        shard = sync.table.grad[c.index].handle.detach().float()  # (padded/dp,)
        whole = shard
        if ctx.dp_size > 1:
            whole = shard.new_empty(c.padded)  # (padded,)
            ctx.comm.all_gather(whole, shard.contiguous(), group=ctx.dp_group)
        for name, off, shape in zip(c.names, c.offsets, c.shapes):
            out[name] = whole[off:off + torch.Size(shape).numel()].view(shape)
    return out


def _train_on_rank(rank: int, world: int, plan: str,
                   family: str = "mixtral") -> dict[str, float]:
    from kernels_runtime import parallelize
    from kernels_runtime.memory.expert_chunks import ExpertChunkSync

    from helpers.distributed import context

    ctx = context(plan)
    share = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    reference, model = _model(family), _model(family)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                             ctx=ctx, verbose=False)
    sync, layouts = opt.sync, model.parallel_state.layouts
    errors = {"not two chunk syncs": float(not isinstance(sync, ExpertChunkSync)
                                           or sync.experts is None)}
    for step in range(STEPS):
        _backward_both(model, opt, reference, ref_opt, ctx, share, step, errors)
        if step == 0:
            ref = dict(reference.named_parameters())
            grads = {**_chunk_grads(sync.dense), **_chunk_grads(sync.experts)}
            errors["not every parameter's gradient"] = float(set(grads) != set(ref))
            for name, grad in grads.items():
                expected = _local_part(ref[name].grad, layouts.get(name), grad.shape)
                errors[f"grad {name}"] = _rel(grad, expected)
            ref_norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm()
            errors["grad norm"] = _rel(torch.tensor(opt.global_grad_norm(sync.master_grads())),
                                       ref_norm)
        ref_opt.step()
        opt.step()
    tiers = sync.tier_bytes()
    away = tiers["disk"] if "host_mem=0" in plan else tiers["host"]
    errors["nothing offloaded"] = float(away == 0)
    errors["state left on the device"] = float(sync.last_step["device_state_peak"] >= away)
    errors.update(_saved(model, reference))
    return errors


# params, masters and momentum on disk beyond a zero host budget; gradients stay on the device
DISK = "offload=static offload_params=1 offload_optim=1 host_mem=0"


@pytest.mark.parametrize("plan", [f"ep=2 zero=2 {OFFLOAD}", f"ep=2 zero=3 {OFFLOAD}",
                                  f"ep=2 zero=2 {DISK}"], ids=["zero2-host", "zero3-host",
                                                              "zero2-disk"])
def test_ep2_with_state_offloaded_trains_like_one_process(ranks, plan):
    _assert_close(ranks(2).run(_train_on_rank, plan, timeout_s=120))


FULL = [("mixtral", f"ep=2 zero=2 {OFFLOAD}"), ("mixtral", f"ep=2 zero=3 {OFFLOAD}"),
        ("mixtral", f"ep=2 zero=3 {DISK}"), ("qwen2_moe", f"ep=2 zero=2 {DISK}"),
        ("mixtral", f"ep=2 tp=2 zero=2 {OFFLOAD}"), ("qwen2_moe", f"ep=2 tp=2 zero=3 {DISK}")]


@pytest.mark.full
@pytest.mark.parametrize("family, plan", FULL, ids=[
    f"{f}-{'-'.join(p.split()[1:p.split().index('offload=static')])}-"
    f"{'disk' if 'host_mem' in p else 'host'}" for f, p in FULL])
def test_ep2_over_four_ranks_with_state_offloaded_trains_like_one_process(ranks, family, plan):
    """dp=4 ep=2: the experts' chunks are reduce-scattered and gathered over an expert-data
    group of 2 ranks (on 2 ranks that group is one rank and moves nothing); Qwen2-MoE's
    shared expert is a non-expert parameter. ep=2 tp=2 (dp=2): both kinds of chunk hold tp
    shards (attention, shared expert, each expert split over tp), chunked by their layouts."""
    _assert_close(ranks(4).run(_train_on_rank, plan, family, timeout_s=180))


def test_plan_takes_offload_under_ep_and_explains_what_it_does_not_do_yet():
    """Static and automatic placement, budgets and tp beside offload validate under ep; a
    pipeline beside offload is refused as it is without ep."""
    from kernels_runtime.mesh.plan import Plan, PlanError

    for plan, world in ((f"ep=2 zero=2 {OFFLOAD}", 2), ("ep=2 zero=3 offload=auto", 2),
                        ("ep=2 zero=2 offload=auto device_mem=1GiB host_mem=1GiB", 2),
                        ("ep=2 zero=2 offload=static offload_optim=1 device_mem=1GiB", 2),
                        (f"ep=2 tp=2 zero=2 {OFFLOAD}", 4), ("ep=2 tp=2 zero=3 offload=auto", 4)):
        assert Plan.parse(plan).validate(world).ep == 2
    with pytest.raises(PlanError, match=r"offload with pipeline parallelism \(pp=2\) is not "
                                        r"available yet: use pp=1 or offload=none"):
        Plan.parse("ep=2 pp=2 zero=2 offload=auto").validate(4)


def _inference_refused(rank: int, world: int) -> str:
    from kernels_runtime import parallelize_model
    from kernels_runtime.mesh.plan import PlanError

    from helpers.distributed import context

    with pytest.raises(PlanError) as refused:
        parallelize_model(_model("mixtral"), ctx=context(f"ep=2 zero=2 {OFFLOAD}"),
                          verbose=False)
    return str(refused.value)


def test_parallelize_model_explains_offload_under_ep_is_for_training(ranks):
    message = ranks(2).run(_inference_refused, timeout_s=60)[0]
    assert "available for training only" in message and "without offload" in message
