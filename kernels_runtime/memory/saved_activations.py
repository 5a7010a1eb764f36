"""Bytes autograd keeps for backward, measured on a live forward pass.

Activation memory is the part of training memory a plan changes most (micro-batches,
checkpointing), and on a CPU there is no allocator counter to read it from. What backward needs
is exactly what autograd saves, so ``SavedActivations`` counts it with
``torch.autograd.graph.saved_tensors_hooks``: the distinct storages saved while it is active,
excluding parameters (they are model state, counted by ``memory_breakdown``), attributed to the
block whose forward saved them or to ``"outside"``.

Under activation checkpointing a block saves only its inputs (the checkpoint saves them before
it enters its own saved-tensor hooks); what it recomputes in backward is invisible to outer
hooks, so ``peak_saved_bytes`` measures the largest block once more with checkpointing removed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one: model state, which no activation meter counts."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class BlockHookMeter:
    """What every saved-tensor meter does on exit: its saved-tensor hooks off, its block hooks
    removed (subclasses set ``_hooks`` and ``_handles``)."""

    _hooks: torch.autograd.graph.saved_tensors_hooks
    _handles: list

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, tb)
        for h in self._handles:
            h.remove()
        self._handles.clear()


class SavedActivations(BlockHookMeter):
    """``with SavedActivations(blocks) as saved: loss = model(x)``, then ``saved.total`` and
    ``saved.by_block`` (bytes per block, ``"outside"`` for the rest)."""

    def __init__(self, blocks: list[nn.Module] | None = None) -> None:
        self.blocks = list(blocks or [])
        self.by_block: dict[str, int] = defaultdict(int)
        self._seen: set[int] = set()
        self._current: list[str] = []
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if is_parameter(t):
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.by_block[self._current[-1] if self._current else "outside"] += storage.nbytes()
        return t

    def _enter_block(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self._current.append(name)

        return hook

    def _leave_block(self, module: nn.Module, args: tuple, output: object) -> None:
        self._current.pop()  # returns None: a forward hook's return value replaces the output

    def __enter__(self) -> SavedActivations:
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._enter_block(f"block{i}")))
            self._handles.append(block.register_forward_hook(self._leave_block))
        self._hooks.__enter__()
        return self


    @property
    def total(self) -> int:
        return sum(self.by_block.values())

    @property
    def largest_block(self) -> int:
        return max((v for k, v in self.by_block.items() if k != "outside"), default=0)


def peak_saved_bytes(step: Callable[[], None], blocks: list[nn.Module]) -> int:
    """Peak bytes kept for backward by ``step`` (one micro-batch's forward and backward).

    Without checkpointing: everything saved. With checkpointed blocks: what is saved with
    checkpointing (their inputs, and everything outside them) plus the largest block measured
    once more with checkpointing removed, which is what backward holds while recomputing it.
    ``step`` then runs twice; checkpointing is restored afterwards.
    """
    return measured_with_replay(step, blocks, SavedActivations, lambda saved: saved.total)


def measured_with_replay(step: Callable[[], None], blocks: list[nn.Module],
                         meter: Callable[[list[nn.Module]], Any],
                         value: Callable[[Any], int]) -> int:
    """``value(meter)`` of ``step`` run under ``meter(blocks)`` (a context manager with a
    ``largest_block``); with checkpointed blocks, plus the largest block measured once more
    with checkpointing removed (what backward holds while it recomputes that block)."""
    from kernels_runtime.parallel.activation_checkpoint import (
        apply_activation_checkpointing,
        is_checkpointed,
        remove_activation_checkpointing,
    )

    checkpointed = [b for b in blocks if is_checkpointed(b)]
    with meter(blocks) as measured:
        step()
    if not checkpointed:
        return value(measured)
    remove_activation_checkpointing(checkpointed)
    try:
        with meter(blocks) as full:
            step()
    finally:
        apply_activation_checkpointing(checkpointed)
    return value(measured) + full.largest_block
