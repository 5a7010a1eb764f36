"""What an ``Engine`` sets up before its first step: the model parallelized for inference, and
the size of its paged KV cache.

Both are collective and happen once, on every rank of the pool, with the same arguments; both
can refuse (a plan the engine does not serve, a budget that holds no block) before any request
arrives. Kept apart from ``engine.py``, which is about serving requests step by step once these
parts exist.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.byte_sizes import human_bytes, parse_bytes
from kernels_runtime.inference.kv_cache import LayerShape, blocks_for, bytes_per_block
from kernels_runtime.inference.moe_plans import (
    dense_context,
    moe_policy,
    moe_problem,
    parallelized_problem,
    split_experts,
)
from kernels_runtime.inference.plans import inference_plan, inference_problem
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan, PlanError
from kernels_runtime.parallel.state import ParallelState, parallel_state

# the default KV cache of all ranks sharing a device (or host) together takes at most this
# share of its memory free after the weights loaded: the rest is for activations, the runtime
# and, on a host, everything else running there
KV_SHARE = 0.5


def parallelized_for_inference(model: nn.Module, plan: Plan | str | None, ctx: Any, comm: Any,
                               spill_dir: str | None, verbose: bool
                               ) -> tuple[nn.Module, ParallelState, int]:
    """``model`` parallelized without an optimizer (``parallelize_model``: tensor-parallel
    heads, pipeline stages, weights on host or disk under an offloading plan; experts split
    over ep and tp, ``moe_plans.py``), its state and its ep size. A model parallelized before
    is taken as it is (ep 1). A plan the engine cannot serve is a ``PlanError`` saying why."""
    from kernels_runtime.api import parallelize_model

    state, ep = parallel_state(model), 1
    if state is None:
        if ctx is None:
            ctx = ParallelContext.build(inference_plan(plan), comm)
        problem = inference_problem(ctx.plan) or moe_problem(model, ctx.plan)
        if problem:
            raise PlanError(problem)
        model = parallelize_model(model, ctx=dense_context(ctx), policy=moe_policy(model),
                                  spill_dir=spill_dir, verbose=verbose)
        state, ep = parallel_state(model), ctx.plan.ep
        split_experts(model, state, ctx, verbose)  # mixture-of-experts: moe_plans.py
    assert state is not None
    problem = inference_problem(state.ctx.plan) or parallelized_problem(state.ctx.plan)
    if problem:
        raise PlanError(problem)
    return model, state, ep


def kv_blocks(kv_mem: int | str | None, shapes: list[LayerShape], dtype: torch.dtype,
              block_size: int, max_num_seqs: int, max_model_len: int,
              ctx: ParallelContext) -> tuple[int, int]:
    """This rank's KV budget in bytes (``kv_mem``, or the default below) and the number of
    blocks of ``block_size`` tokens every rank holds: the fewest any rank's budget fits, so one
    block table serves them all. A budget that holds no block is a ``ValueError``."""
    budget = parse_bytes(kv_mem) if kv_mem is not None else \
        _default_budget(shapes, dtype, max_num_seqs, max_model_len)
    blocks = torch.tensor([blocks_for(budget, shapes, block_size, dtype)])
    ctx.comm.all_reduce(blocks, op=dist.ReduceOp.MIN)  # one block table fits all
    num_blocks = int(blocks)
    if num_blocks < 1:
        per = bytes_per_block(shapes, block_size, dtype)
        raise ValueError(f"kv_mem={human_bytes(budget)} holds no KV block of "
                         f"{block_size} tokens ({human_bytes(per)} on this rank); give at "
                         "least that")
    return budget, num_blocks


def _default_budget(shapes: list[LayerShape], dtype: torch.dtype, max_num_seqs: int,
                    max_model_len: int) -> int:
    """Every sequence at full length, capped at KV_SHARE of the memory free now (the weights
    are loaded) on this rank's device, or its host, divided among the ranks sharing it; the
    cache's pages are taken as blocks are written (kv_cache.py)."""
    from kernels_runtime.comm.accelerator import Accelerator
    from kernels_runtime.memory.free import default_budget, local_ranks

    per_token = bytes_per_block(shapes, 1, dtype)
    want = max_num_seqs * min(max_model_len, 4096) * per_token
    return default_budget(Accelerator.for_backend(dist.get_backend()), KV_SHARE, want,
                          local_ranks(dist.get_world_size()))
