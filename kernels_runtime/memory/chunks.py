"""Chunks: a model's trainable parameters packed into flat, fixed-size pieces in execution order
(and its frozen ones, as a group of their own: ``frozen_chunks.py``).

Why chunks and not parameters: placement, movement and collectives work on a few large
contiguous tensors instead of hundreds of small ones (one all-gather, one file, one optimizer
call per chunk), and in execution order, so "the chunk used next" is the next chunk. Why not one
flat buffer: a device budget smaller than the model must hold only the chunks in use.

A *unit* is what is fetched and released together around one forward: each of the policy's
blocks, and every module outside them that owns parameters directly (embeddings, the final norm,
the LM head). A chunk holds parameters of one unit, one optimizer param group and one
tensor-parallel layout signature, at most ``chunk_bytes`` (a larger parameter gets a chunk of its
own), padded to a multiple of dp so each rank owns an equal shard. A parameter tied into a
second unit (GPT-2's LM head) stays in the chunk of the unit that registered it; the second unit
needs that chunk too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels_runtime.parallel.data.buckets import Bucket, flat_segments


@dataclass(eq=False)
class ChunkLayout:
    index: int
    unit: int  # the unit that registered these parameters
    group: int  # the optimizer param group
    names: list[str]
    params: list[nn.Parameter] = field(repr=False)
    offsets: list[int]
    shapes: list[tuple[int, ...]]  # each parameter's shape (released parameters are empty)
    numel: int
    padded: int  # numel rounded up to a multiple of dp
    dp: int
    frozen: bool = False  # weights only (requires_grad False): no gradient, master or states

    shard_size = Bucket.shard_size
    shard_range = Bucket.shard_range

    def segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Params overlapping flat range [start, end) (by their shapes: released ones are
        empty)."""
        return flat_segments([math.prod(s) for s in self.shapes], self.offsets, start, end)

    def flat_values(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The parameters' current values as one padded flat tensor."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)  # (padded,)
        for p, off in zip(self.params, self.offsets):
            flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    def point_params_at(self, full: torch.Tensor) -> None:
        """Make the parameters views of ``full`` (the gathered chunk, (padded,))."""
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = full[off:off + math.prod(shape)].view(shape)

    def detach_params(self) -> None:
        """Parameters hold no memory while released: an empty tensor, so any use of a released
        parameter fails loudly instead of computing with stale values."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


@dataclass(eq=False)
class Unit:
    module: nn.Module
    path: str
    chunks: list[int] = field(default_factory=list)  # every chunk its forward needs


def find_units(model: nn.Module, blocks: list[nn.Module]) -> list[Unit]:
    """The blocks and the parameter-owning modules outside them, in registration order (the
    execution order of the transformer families; the first step's trace corrects the rest)."""
    block_ids = {id(b) for b in blocks}
    inside: set[int] = set()
    units = []
    for path, module in model.named_modules():
        if id(module) in inside:
            continue
        if id(module) in block_ids:
            units.append(Unit(module, path))
            inside.update(id(m) for m in module.modules())
        elif any(True for _ in module.parameters(recurse=False)):
            units.append(Unit(module, path))
    return units


def _unit_params(unit: Unit, blocks: set[int]) -> list[nn.Parameter]:
    recurse = id(unit.module) in blocks
    return list(unit.module.parameters(recurse=recurse))


def build_chunks(
    units: list[Unit], blocks: list[nn.Module],
    groups: list[list[tuple[str, nn.Parameter]]], dp: int, chunk_bytes: int,
    key: Callable[[str], Hashable] = lambda name: (),
) -> list[ChunkLayout]:
    """Pack the optimizer's parameters into chunks (see the module docstring); records on each
    unit which chunks its forward needs."""
    group_of = {id(p): (g, name) for g, named in enumerate(groups) for name, p in named}
    block_ids = {id(b) for b in blocks}
    chunk_of: dict[int, int] = {}
    chunks: list[ChunkLayout] = []
    for u, unit in enumerate(units):
        open_chunks: dict[Hashable, tuple[list[tuple[str, nn.Parameter]], list[int]]] = {}
        for p in _unit_params(unit, block_ids):
            if id(p) in chunk_of or id(p) not in group_of:
                continue
            g, name = group_of[id(p)]
            slot = (g, key(name))
            nbytes = p.numel() * p.element_size()
            if slot in open_chunks and open_chunks[slot][1][0] + nbytes > chunk_bytes:
                chunks.append(_make(len(chunks), u, g, open_chunks.pop(slot)[0], dp))
            named, size = open_chunks.setdefault(slot, ([], [0]))
            named.append((name, p))
            size[0] += nbytes
            chunk_of[id(p)] = -1  # claimed by this unit; the chunk index comes below
        for (g, _), (named, _) in open_chunks.items():
            chunks.append(_make(len(chunks), u, g, named, dp))
        for c in chunks:
            for q in c.params:
                chunk_of[id(q)] = c.index
    for unit in units:
        needed = {chunk_of[id(p)] for p in _unit_params(unit, block_ids) if id(p) in chunk_of}
        unit.chunks = sorted(needed)
    return chunks


def _make(index: int, unit: int, group: int, named: list[tuple[str, nn.Parameter]],
          dp: int) -> ChunkLayout:
    offsets, total = [], 0
    for _, p in named:
        offsets.append(total)
        total += p.numel()
    padded = max(dp, math.ceil(total / dp) * dp)
    return ChunkLayout(index, unit, group, [n for n, _ in named], [p for _, p in named],
                       offsets, [tuple(p.shape) for _, p in named], total, padded, dp)
