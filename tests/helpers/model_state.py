"""Model state as tests compare it: full parameter values out of any layout, the ZeRO paper's
count of model-state bytes per rank, and the activations a micro-batch keeps for backward."""

from __future__ import annotations

import torch

from helpers import models as dm
from helpers.distributed import context


def state_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value from the model state's written pieces (each element
    written by exactly one rank), summed over the world: any layout, offloaded or not."""
    import torch.distributed as dist

    state = model.parallel_state
    shapes = {p.shard.name: p.shard.shape for p in state.model_state.pieces(True, None)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, shapes)
    full = {name: torch.zeros(shape, dtype=torch.float32)
            for found in every for name, shape in sorted(found.items())}
    for piece in state.model_state.pieces(True, None):
        s = piece.shard
        box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
        full[s.name][box] += piece.values["param"].float()
    for t in full.values():
        dist.all_reduce(t)
    return full


def model_state_bytes(world: int, zero: int) -> int:
    """Model-state bytes per rank in fp32 under AdamW (ZeRO paper's count)."""
    numel = sum(p.numel() for p in dm.make_model("gpt2").parameters())
    per_param = 4 + 12 / world if zero == 2 else 16 / world
    return int(numel * per_param)


def activation_bytes(rank: int, world: int, accum: int, plan: str | None = None) -> int:
    """What one micro-batch keeps for backward, parameters aside: the device reserve automatic
    placement should measure. On a plain model, or on one parallelized under ``plan`` (tensor
    parallelism changes what is saved; no offload, so parameters are ordinary)."""
    from kernels_runtime import parallelize_model
    from kernels_runtime.memory.saved_activations import SavedActivations

    model = dm.make_model("gpt2")
    ctx = context(plan) if plan else None
    if plan and "bf16" in plan:  # 16-bit compute saves 16-bit activations
        model, plan, ctx = model.to(torch.bfloat16), None, None
    if plan:
        model = parallelize_model(model, ctx=ctx, verbose=False)
    batch = dm.local_microbatches(0, ctx.dp_rank if ctx else rank, ctx.dp_size if ctx else world,
                                  accum)[0]
    with SavedActivations() as saved:
        dm.hf_loss(model, batch)
    return saved.total
