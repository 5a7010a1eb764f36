"""The KV cache's tensors: for each attention layer this rank runs, keys and values in blocks.

Per layer, ``keys`` and ``values`` are ``(kv_heads, slots, head_dim)`` with ``slots =
num_blocks * block_size``: a token's slot is ``block * block_size + offset``, so writing a
step's new keys is one indexed copy, and a sequence whose blocks are consecutive (the block
pool arranges that where it can) has its keys as a plain slice, each head's rows contiguous,
which attention reads in place: gathering them instead costs nine times as much on a CPU.
``kv_heads`` is this rank's share under tensor parallelism, and a pipeline stage holds only its
own layers; the block count is the same on every rank of a replica, so one block table serves
all of them.

The number of blocks comes from a memory budget (``blocks_for``), not from a worst case of
maximum prompt plus maximum output times maximum batch (ColossalAI's engine preallocates that).
Host copies of blocks (preemption by swapping) are pinned on GPU machines so the copies can
overlap with compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    head_dim: int


def bytes_per_block(layers: list[LayerShape], block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block over this rank's layers."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * s.kv_heads * s.head_dim * size for s in layers)


def blocks_for(budget: int, layers: list[LayerShape], block_size: int,
               dtype: torch.dtype) -> int:
    per = bytes_per_block(layers, block_size, dtype)
    return budget // per if per else 0


class PagedKVCache:
    def __init__(self, layers: list[LayerShape], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.block_size, self.dtype, self.device = (
            num_blocks, block_size, dtype, device)
        # empty, not zeros: a slot is read only after its token's keys were written (attention
        # reads a sequence's first ``length`` slots), and on a host untouched pages cost no
        # RSS, so memory follows the blocks used, not the budget
        self.keys = [torch.empty(s.kv_heads, num_blocks * block_size, s.head_dim, dtype=dtype,
                                 device=device) for s in layers]
        self.values = [torch.empty_like(k) for k in self.keys]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer``, (kv_heads, slots, head_dim) each."""
        return self.keys[layer], self.values[layer]

    def _blocks(self) -> list[torch.Tensor]:
        """Every layer's keys, then values, as (kv_heads, num_blocks, block_size, head_dim)."""
        return [t.view(t.shape[0], self.num_blocks, self.block_size, t.shape[2])
                for t in [*self.keys, *self.values]]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` into ``dst`` in every layer (copy on write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for t in self._blocks():
            t[:, dst] = t[:, src]

    def save_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """Host copies of ``blocks`` (every layer's keys, then values): a swapped-out
        sequence's cache."""
        index = torch.tensor(blocks, device=self.device)
        pin = self.device.type != "cpu"
        out = []
        for t in self._blocks():
            host = torch.empty((t.shape[0], len(blocks), *t.shape[2:]), dtype=t.dtype,
                               pin_memory=pin)
            host.copy_(t[:, index], non_blocking=pin)
            out.append(host)
        return out

    def load_blocks(self, saved: list[torch.Tensor], blocks: list[int]) -> None:
        index = torch.tensor(blocks, device=self.device)
        for t, host in zip(self._blocks(), saved):
            t[:, index] = host.to(self.device, non_blocking=True)
