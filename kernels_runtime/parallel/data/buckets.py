"""Flat buckets: parameters and gradients laid out in contiguous buffers, sharded over dp.

Why flat: one collective per bucket instead of one per parameter, and an equal-sized shard of
every bucket per data-parallel rank, so ZeRO's reduce-scatter and all-gather move contiguous
memory. Each bucket holds parameters of one optimizer param group (they share hyperparameters)
with the same sharding over the other axes (a bucket's gradient norm and checkpoint writers are
decided once for all its elements), in reverse registration order (roughly the order backward
produces their gradients), padded to a multiple of the dp size.

Model parameters become views into the bucket's parameter buffer, so there is no second copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    group_index: int  # which optimizer param group
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]  # flat offset of each param in the bucket
    numel: int  # sum of param sizes (without padding)
    padded: int  # numel rounded up to a multiple of dp
    dp: int
    flat_param: torch.Tensor = field(repr=False, default=None)  # (padded,) in model dtype

    @property
    def shard_size(self) -> int:
        return self.padded // self.dp

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        return dp_rank * self.shard_size, (dp_rank + 1) * self.shard_size

    def segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        return flat_segments([p.numel() for p in self.params], self.offsets, start, end)


def flat_segments(sizes: list[int], offsets: list[int], start: int,
                  end: int) -> list[tuple[int, int, int]]:
    """Tensors of ``sizes`` at flat ``offsets`` overlapping [start, end): (index, tensor-local
    start, end)."""
    out = []
    for i, (size, off) in enumerate(zip(sizes, offsets)):
        lo, hi = max(start, off), min(end, off + size)
        if lo < hi:
            out.append((i, lo - off, hi - off))
    return out


def build_buckets(
    param_groups: list[list[tuple[str, nn.Parameter]]],
    dp: int,
    bucket_bytes: int,
    key: Callable[[str], Hashable] = lambda name: (),
) -> list[Bucket]:
    """Split each param group's parameters into buckets of about ``bucket_bytes``; parameters
    whose ``key`` differs never share a bucket."""
    buckets: list[Bucket] = []
    for g, named in enumerate(param_groups):
        open_buckets: dict[Hashable, tuple[list[tuple[str, nn.Parameter]], list[int]]] = {}
        for name, p in reversed(named):
            current, size = open_buckets.setdefault(key(name), ([], [0]))
            current.append((name, p))
            size[0] += p.numel() * p.element_size()
            if size[0] >= bucket_bytes:
                buckets.append(_make_bucket(len(buckets), g, current, dp))
                del open_buckets[key(name)]
        for current, _ in open_buckets.values():
            buckets.append(_make_bucket(len(buckets), g, current, dp))
    return buckets


def _make_bucket(index: int, group: int, named: list[tuple[str, nn.Parameter]], dp: int) -> Bucket:
    offsets, total = [], 0
    for _, p in named:
        offsets.append(total)
        total += p.numel()
    padded = max(dp, math.ceil(total / dp) * dp)
    bucket = Bucket(index, group, [p for _, p in named], [n for n, _ in named], offsets,
                    total, padded, dp)
    first = bucket.params[0]
    flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
    for p, off in zip(bucket.params, offsets):
        flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[off:off + p.numel()].view_as(p)  # the parameter now lives in the bucket
    bucket.flat_param = flat
    return bucket
