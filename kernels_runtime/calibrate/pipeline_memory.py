"""Activation memory of a pipelined step, measured: the most autograd holds at once.

A pipeline stage keeps several micro-batches' activations alive (under 1F1B up to p on the
first stage) and a step's forwards and backwards interleave, so what one micro-batch saves
(``peak_saved_bytes``) does not give the stage's peak. ``LiveSaved`` counts saved storages
while autograd holds them: its pack hook adds a storage's bytes when a graph first saves it and
returns a token whose release (the graph freed by its backward) subtracts them, so ``peak`` is
the most held at once over a whole schedule. Parameters are model state, not counted.

Under activation checkpointing outer hooks see only the blocks' inputs; the block being
recomputed (one at a time) is measured as ``peak_saved_bytes`` does: the step runs once more
without checkpointing and the largest single block forward is added. Under zbv the weight
gradients' inputs wait for W in the deferred queue, not in a graph, so this counts them freed
at B (the cost model holds them until W).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernels_runtime.memory.saved_activations import (
    BlockHookMeter,
    is_parameter,
    measured_with_replay,
)


class _Held:
    """What the graph keeps instead of a saved tensor; its release frees the bytes."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: LiveSaved, key: int, tensor: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner._release(self.key)


class LiveSaved(BlockHookMeter):
    """``with LiveSaved(blocks) as live: <forwards and backwards>``, then ``live.peak`` (bytes)
    and ``live.largest_block`` (the most one block forward saved)."""

    def __init__(self, blocks: list[nn.Module] | None = None) -> None:
        self.blocks = list(blocks or [])
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.held = self.peak = self.largest_block = 0
        self._call: set[int] | None = None  # storages saved by the block forward running
        self._call_bytes = 0
        self._handles: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if is_parameter(t):
            return t
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return t
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, nbytes]
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        else:
            entry[0] += 1
        if self._call is not None and key not in self._call:
            self._call.add(key)
            self._call_bytes += nbytes
        return _Held(self, key, t)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.held -= entry[1]

    def _enter_block(self, module: nn.Module, args: tuple) -> None:
        self._call, self._call_bytes = set(), 0

    def _leave_block(self, module: nn.Module, args: tuple, output: object) -> None:
        self.largest_block = max(self.largest_block, self._call_bytes)
        self._call = None  # returns None: a forward hook's return value replaces the output

    def __enter__(self) -> LiveSaved:
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._enter_block))
            # first among the forward hooks: a stage's last block ends its forward by raising
            # from its own hook (``StageExit``), which would skip hooks registered after it
            self._handles.append(block.register_forward_hook(self._leave_block, prepend=True))
        self._hooks.__enter__()
        return self



def peak_live_bytes(step: Callable[[], None], blocks: list[nn.Module]) -> int:
    """Peak activation bytes held during ``step`` (a pipeline schedule's forwards and
    backwards), plus, with checkpointed blocks, the largest block recomputed in backward."""
    return measured_with_replay(step, blocks, LiveSaved, lambda live: live.peak)
