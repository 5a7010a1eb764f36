"""``ep`` with ``offload=auto`` under a ``device_mem`` budget trains like one process (issue 29).

What is protected: under ``ep=2 offload=auto`` the two chunk syncs (``memory/expert_chunks.py``:
non-expert chunks over dp, expert slices over their expert-data group) place their payloads
through one store and one placer, so ``device_mem`` (and ``host_mem``) is one budget for the
rank that dense and expert chunks are evicted against together. The tiny Mixtral of
``test_expert_parallelize.py`` on 2 gloo ranks, SGD with momentum, fp32, zero 2 and 3, each step
one measured micro-batch (``sync.micro_batch``, as ``train_step`` runs it), under a
``device_mem`` of two fifths of the model state a first, unbounded run measured plus the
activations it measured, gives the single-process model's 5 steps: losses (language-model plus
load-balancing loss), first-step gradients of every parameter (read from both syncs' reduced
gradient shards), the global gradient norm and the final parameters as a checkpoint writes them,
within 1e-5 relative L2. And the placement is what it claims: one placer and store under both
syncs, whose device floor is a unit's chunks of both kinds; every step evicted; each kind of
chunk had payloads on the device, and payloads off it, after a forward or a step; from the
second step (the first measures the activations as they come) the device peak of model state,
working buffers and reserved activations together stays within ``device_mem``, but for what a
step's activations grew over the last step's (routing changes what the experts save: the growth
exists before room can be made for it); with a host budget, payloads went to disk. On 4 ranks
(full tier): beside tp=2 (zero 2; and zero 3 on Qwen2-MoE with a ``host_mem`` of the least a
step needs there, so the rest goes to disk; on 2 ranks the largest expert chunk's step alone
outweighs what leaves the device), and at dp=4 (expert-data groups of 2 ranks, whose gathers and
reductions then run).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_expert_offload import _chunk_grads
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


def _parallelized(plan: str, family: str):
    """The reference, its optimizer, the context, the parallelized model and its optimizer."""
    from kernels_runtime import parallelize

    from helpers.distributed import context

    ctx = context(plan)
    reference, model = _model(family), _model(family)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                             ctx=ctx, verbose=False)
    return reference, ref_opt, ctx, model, opt


def _share(ctx) -> slice:
    return slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)


def _step_both(model, opt, reference, ref_opt, ctx, step: int, errors: dict,
               seen: list | None = None) -> None:
    """``_backward_both`` with the model's forward and backward one micro-batch of the
    offloaded model, as ``train_step`` runs one (``sync.micro_batch`` from the forward to the
    end of the gradient sync), so the placement measures and reserves its activations; the
    reference, forward and backward, runs before it and is not counted. ``seen`` gets where
    each kind of chunk is after the forward (``_kinds``)."""
    with contextlib.ExitStack() as micro_batch:
        def measured(*args, **kwargs):  # noqa: ANN202 - the model's output
            micro_batch.enter_context(opt.sync.micro_batch())
            out = model(*args, **kwargs)
            if seen is not None:
                seen.append(_kinds(opt.sync))
            return out

        _backward_both(measured, opt, reference, ref_opt, ctx, _share(ctx), step, errors)


def _budgets(base: str, family: str) -> str:
    """``device_mem``: two fifths of a rank's model state (both kinds, measured with no device
    budget over two steps: the first creates the momentum) plus the activations a micro-batch
    kept; ``host_mem`` (where ``base`` asks for ``host_mem``): the least one step needs
    on the host; each the largest of the ranks' (one plan for every rank)."""
    from kernels_runtime.memory.tiers import Tier

    disk = "host_mem" in base
    base = " ".join(w for w in base.split() if w != "host_mem")
    reference, ref_opt, ctx, model, opt = _parallelized(f"{base} offload=auto", family)
    state = activations = 0
    for step in range(2):
        _step_both(model, opt, reference, ref_opt, ctx, step, {})
        ref_opt.step()
        opt.step()
        last = opt.sync.last_step
        state = max(state, last["device_state_peak"])
        activations = max(activations, last["activations"])
    budgets = torch.tensor([state * 2 // 5 + activations, opt.sync.placer.floor[Tier.HOST]])
    torch.distributed.all_reduce(budgets, op=torch.distributed.ReduceOp.MAX)  # one plan
    device, host = budgets.tolist()
    return f"{base} device_mem={device}" + (f" host_mem={host}" if disk else "")


def _kinds(sync) -> dict[str, int]:
    """Bytes of each kind of chunk on the device and off it now (the shared placer's
    residents; expert payload keys carry the expert prefix)."""
    from kernels_runtime.memory.expert_chunks import EXPERT_PREFIX
    from kernels_runtime.memory.tiers import Tier

    out = {f"{k} {w}": 0 for k in ("dense", "experts") for w in ("on", "off")}
    for tier, resident in sync.placer.resident.items():
        for key, payload in resident.items():
            kind = "experts" if key.startswith(EXPERT_PREFIX) else "dense"
            out[f"{kind} {'on' if tier == Tier.DEVICE else 'off'}"] += payload.nbytes
    return out


def _readable(sync) -> None:
    """Gradient shards the placement sent to disk read back (to read them, not to use them)."""
    from kernels_runtime.memory.tiers import Tier

    for s in sync.syncs():
        for grad in s.table.grad:
            if grad is not None and grad.tier == Tier.DISK:
                s.placer.bring(grad, Tier.HOST, reads_only=True)


def _train_on_rank(rank: int, world: int, base: str, family: str = "mixtral") -> dict:
    """``base``: the plan without offload; a word ``host_mem`` in it: a host budget too."""
    from kernels_runtime.memory.tiers import Tier

    plan = _budgets(base, family)
    reference, ref_opt, ctx, model, opt = _parallelized(f"{plan} offload=auto", family)
    budget = ctx.plan.device_mem
    sync, layouts = opt.sync, model.parallel_state.layouts
    errors = {"not one placer under both syncs": float(
        sync.experts is None or not sync.dense.placer is sync.experts.placer is sync.placer
        or sync.experts.store is not sync.dense.store)}
    # a unit's forward gathers its chunks of both kinds (fp32 parameters and gradients)
    unit_bytes = [8 * sum(s.chunks[i].padded for s in sync.syncs() for i in s.units[u].chunks)
                  for u in range(len(sync.dense.units))]
    errors["device floor not a unit's chunks of both kinds"] = float(
        sync.placer.floor[Tier.DEVICE] != max(unit_bytes))
    seen = []  # bytes of each kind on and off the device after each forward and step
    measured = []  # the activations each step kept (its micro-batch's reserve)
    spilled = False  # a payload moved to or from disk
    for step in range(STEPS):
        _step_both(model, opt, reference, ref_opt, ctx, step, errors, seen)
        if step == 0:
            _readable(sync)
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
        last, kinds = sync.last_step, _kinds(sync)
        errors[f"no eviction in step {step}"] = float(last["evictions"] == 0)
        spilled = spilled or any("disk" in pair for pair in last["moved"])
        seen.append(kinds)
        if step:  # the first step measured the activations as they came; later ones
            # start with the last step's reserved, and routing may make one save more
            growth = max(0, last["activations"] - measured[-1])
            errors[f"over device_mem in step {step}"] = float(
                last["device_total_peak"] > budget + growth)
        measured.append(last["activations"])
    for kind in kinds:  # each kind held on the device, and placed off it, by the one budget
        errors[f"no {kind} the device after a forward or step"] = float(
            not any(k[kind] for k in seen))
    if ctx.plan.host_mem is not None:
        errors["nothing spilled to disk"] = float(not spilled)
    errors.update(_saved(model, reference))
    return {"errors": errors, "plan": plan, "kinds": seen, "last": sync.last_step}


@pytest.mark.slow
@pytest.mark.parametrize("base", ["ep=2 zero=2", "ep=2 zero=3"], ids=["zero2", "zero3"])
def test_ep2_offload_auto_under_device_mem_trains_like_one_process(ranks, base):
    _check(ranks(2).run(_train_on_rank, base, timeout_s=120))


FULL = [("mixtral", "ep=2 tp=2 zero=2"), ("qwen2_moe", "ep=2 tp=2 zero=3 host_mem"),
        ("mixtral", "dp=4 ep=2 zero=3")]


@pytest.mark.full
@pytest.mark.parametrize("family, base", FULL, ids=["-".join([f, *b.split()]) for f, b in FULL])
def test_ep2_offload_auto_over_four_ranks_trains_like_one_process(ranks, family, base):
    """Beside tp=2 (both kinds of chunk hold tp shards), and at dp=4, where the experts'
    chunks are gathered and reduced over an expert-data group of 2 ranks."""
    _check(ranks(4).run(_train_on_rank, base, family, timeout_s=240))


def _check(out: list[dict]) -> None:
    for rank, result in enumerate(out):
        print(f"{result['plan']} rank {rank}: after each forward and step {result['kinds']}, last "
              f"{result['last']}")
    _assert_close([result["errors"] for result in out])
