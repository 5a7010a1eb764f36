"""The pipeline applier (after activation checkpointing, before data parallelism): keep this
rank's stages of the model and record the schedule ``train_step`` runs.

Stages come from the policy's split points: its blocks, balanced by parameter count over the
plan's pp x chunks virtual stages (``partition.py``), with its ``PipelineSpec`` naming what
runs before the blocks (embeddings, on the first stage) and after them (final norm and heads,
on the last). A plain ``nn.Sequential`` model is split over its children. Dropout is seeded
per block and micro-batch from one seed the pipeline shares (``dropout_seeds.py``). Every kept
parameter's layout gains "pp" among its sharded axes (the stages hold different parameters, so
the gradient norm sums over them) and a tied embedding is marked as one of two replicas (first
and last stage), so the norm counts it once and a checkpoint stores it once under its name.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.mesh.validation import pipeline_chunks
from kernels_runtime.parallel.pipeline import weight_grad
from kernels_runtime.parallel.pipeline.dropout_seeds import BlockSeeds
from kernels_runtime.parallel.pipeline.executor import PipelineRunner
from kernels_runtime.parallel.pipeline.partition import partition
from kernels_runtime.parallel.pipeline.schedules import Placement
from kernels_runtime.parallel.pipeline.stage import (
    StageBlocks,
    drop_after,
    find_container,
    stub_before,
    tied_across,
)
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.precision import compute_dtype

HOW_TO_SPLIT = (
    "give the model split points: build it as an nn.Sequential (each child becomes a unit of "
    "a stage), or register a policy whose model_layout has blocks and a "
    "PipelineSpec(before=(embedding paths...), after=(final norm and head paths...)) "
    "(kernels_runtime.policies.register_policy)")


def _split_points(state: ParallelState, model: nn.Module):
    """(blocks, container path, before paths, after paths) or the reason there are none."""
    plan = state.ctx.plan
    layout = state.policy.model_layout(model)
    spec = layout.pipeline if layout is not None else None
    if isinstance(model, nn.Sequential):  # its children are the units, in order
        return list(model), "", [], []
    if not state.blocks:
        return f"pp={plan.pp}: the {state.policy.name} policy finds no blocks in " \
               f"{type(model).__name__}; {HOW_TO_SPLIT}"
    found = find_container(model, state.blocks)
    if found is None:
        return f"pp={plan.pp}: the blocks of {type(model).__name__} are not the children of " \
               f"one module list; {HOW_TO_SPLIT}"
    if spec is None or not (spec.before or spec.after):
        return f"pp={plan.pp}: the {state.policy.name} policy does not say which modules run " \
               f"before and after the blocks of {type(model).__name__}; {HOW_TO_SPLIT}"
    before = [p for p in (_first_path(model, c) for c in spec.before) if p is not None]
    after = [p for p in (_first_path(model, c) for c in spec.after) if p is not None]
    return state.blocks, found[0], before, after


def _first_path(model: nn.Module, candidates: tuple[str, ...]) -> str | None:
    names = dict(model.named_modules())
    return next((c for c in candidates if c in names), None)


def _shared_seeds(ctx) -> BlockSeeds:
    """One base seed for the whole pipeline (drawn on its first stage, broadcast over pp)."""
    base = torch.randint(0, 2**62, (1,), dtype=torch.int64) if ctx.coord("pp") == 0 \
        else torch.zeros(1, dtype=torch.int64)
    base = base.to(ctx.device)
    group = ctx.group("pp")
    ctx.comm.broadcast(base, src=dist.get_global_rank(group, 0), group=group)
    return BlockSeeds(int(base.item()))


def check(state: ParallelState, model: nn.Module) -> str | None:
    plan = state.ctx.plan
    if plan.pp == 1:
        return None
    found = _split_points(state, model)
    if isinstance(found, str):
        return found
    blocks = found[0]
    stages = plan.pp * pipeline_chunks(plan)
    if len(blocks) < stages:
        return (f"pp={plan.pp} x {pipeline_chunks(plan)} chunks needs at least {stages} blocks "
                f"but {type(model).__name__} has {len(blocks)}; use fewer stages or chunks")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    ctx, plan = state.ctx, state.ctx.plan
    if plan.pp == 1:
        return model
    blocks, container_path, before, after = _split_points(state, model)
    chunks = pipeline_chunks(plan)
    place = Placement(plan.pp, chunks, v_shape=plan.pp_schedule == "zbv")
    costs = [sum(p.numel() for p in b.parameters()) or 1 for b in blocks]
    ranges = partition(costs, place.stages)
    me = ctx.coord("pp")
    mine = [place.stage(me, c) for c in range(chunks)]
    first, last = 0 in mine, place.stages - 1 in mine
    tied = tied_across(model, before, after)
    params_before = {id(p): p for p in model.parameters()}
    names_before = {n for n, _ in model.named_parameters()}
    container = model.get_submodule(container_path) if container_path else model
    stage_blocks = StageBlocks(container, [list(ranges[v]) for v in mine], _shared_seeds(ctx),
                               carry=state.stage_carry)
    if not first:
        keep = {pid: params_before[pid] for pid in tied} if last else {}
        stub_before(model, before, keep, compute_dtype(plan.precision))
    if not last:
        drop_after(model, after, "last")
    across = bool(tied) and not (first and last)  # the two copies live on different ranks
    for name, p in model.named_parameters():
        layout = state.layout(name, p)
        index, count = layout.replica  # e.g. a grid's copies, then the two stages' copies
        if across and id(p) in tied:
            index, count = 2 * index + (0 if first else 1), 2 * count
        state.layouts[name] = replace(layout, sharded=layout.sharded | {"pp"},
                                      replica=(index, count))
    held = {id(p) for p in model.parameters()}
    state.elsewhere = names_before - {n for n, _ in model.named_parameters()}
    if state.optimizer is not None:  # it is rebuilt over this stage's parameters only
        for group in state.optimizer.param_groups:
            group["params"] = [p for p in group["params"]
                               if id(state.replaced_params.get(id(p), p)) in held]
    state.blocks = stage_blocks.blocks
    state.schedule = PipelineRunner(
        ctx, stage_blocks, plan.pp_schedule, chunks,
        [params_before[pid] for pid in tied if pid in held] if across else [])
    if plan.pp_schedule == "zbv":  # B and W apart: the linear layers defer their dW
        state.schedule.deferred = weight_grad.DeferredGrads()
        weight_grad.install(model, state.schedule.deferred)
    state.replaced.append((container_path or type(model).__name__,
                           f"pipeline stages {mine} of {place.stages}: blocks "
                           f"{[list(ranges[v]) for v in mine]}"))
    state.applied.append("pipeline")
    return model
