"""Model state as tests compare it: full parameter values out of any layout, and the ZeRO
paper's count of model-state bytes per rank."""

from __future__ import annotations

import torch

from helpers import models as dm


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
