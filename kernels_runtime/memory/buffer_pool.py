"""Freed chunk-sized buffers kept for the next allocation of their size, on a host-only machine.

glibc hands every freed buffer larger than 64 KiB back to the system (``host_malloc.py`` fixes
that threshold so RSS follows the tiers' accounts), so a buffer allocated anew pays a page fault
per 4 KiB page when first written: measured here 40 ms per 100 MB, as much as the arithmetic on
it. Offloading allocates and frees chunk-sized buffers all step long (gradient buffers, disk
reads, parameters published anew), always of the same few sizes, so keeping a few freed ones
saves most of that. A GPU machine needs none of this: its caching allocators (device and pinned
host memory) reuse blocks already.

Only memory nothing else refers to may come back here: a chunk's parameters are viewed by the
model while gathered and autograd keeps those views from a forward to its backward, so a buffer
is kept only when its storage has no other user (``sole_owner``); gradients, masters and
optimizer states, which the runtime alone uses, come back once their last user (a write-behind,
the step) is done with them, parameters once their backward is.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Free tensors by (numel, dtype), at most ``limit`` bytes (None: no limit; the caller
    bounds and accounts them)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.nbytes = 0
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def put(self, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` for reuse; False (not kept) past the limit or for an empty one."""
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes or (self.limit is not None and self.nbytes + nbytes > self.limit):
            return False
        self._free.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)
        self.nbytes += nbytes
        return True

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A kept tensor of exactly this size and dtype (its values are whatever they were)."""
        free = self._free.get((numel, dtype))
        if not free:
            return None
        tensor = free.pop()
        self.nbytes -= tensor.numel() * tensor.element_size()
        return tensor

    def clear(self) -> int:
        """Let everything go; the bytes that were kept."""
        freed, self.nbytes = self.nbytes, 0
        self._free.clear()
        return freed


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def sole_owner(tensor: torch.Tensor, viewed: bool) -> bool:
    """Whether ``tensor`` is the only user of its memory (no view, saved tensor or array refers
    to its storage). Without the count (a torch that lacks it) only memory never ``viewed`` by
    parameters is trusted."""
    if _use_count is None:
        return not viewed
    return _use_count(tensor.untyped_storage()._cdata) <= 2  # the tensor and the storage asked

