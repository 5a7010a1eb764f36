"""Activation checkpointing: keep only each block's inputs and recompute the rest in backward.

A transformer block saves many tensors for backward (attention scores, MLP activations); across
all blocks that is usually the largest share of training memory. Checkpointing a block trades one
extra forward of it during backward for not keeping them (Chen et al. 2016, "Training deep nets
with sublinear memory cost"). Which modules are the blocks is the policy's answer
(``get_policy(model).blocks(model)``); this module only wraps them.

The wrapper replaces the block's ``forward`` on the instance rather than wrapping the module in
another module, so parameter names and ``state_dict()`` keys do not change, module hooks (FSDP's,
telemetry's) stay outside the checkpoint and run once, and removing it restores the block exactly.
It uses ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``, which passes keyword
arguments through, returns whatever the block returns (tensor or tuple) and replays dropout with
the same RNG state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels_runtime.parallel.state import ParallelState

_CACHE_KWARGS = ("use_cache",)


def _is_kv_cache(value: object) -> bool:
    """A transformers KV cache (``DynamicCache``, ...), recognised without importing transformers.

    A cache is written during forward; recomputing the block in backward would write it a second
    time (the replayed attention then sees every key twice), so checkpointed blocks get no cache,
    as transformers' own gradient checkpointing does.
    """
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(value).__mro__
    )


class _CheckpointedForward:
    """The replacement ``forward``: runs the original one under ``checkpoint``.

    A module-level class holding the original bound method, not a closure, so ``copy.deepcopy``
    and pickling a wrapped module produce a copy whose forward calls the copy, not the original.
    ``restore`` is the instance-level ``forward`` that was there before (``None``: the class's).
    """

    def __init__(self, inner: Callable[..., Any], restore: Callable[..., Any] | None) -> None:
        self.inner = inner
        self.restore = restore

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved for backward, so nothing to recompute
            return self.inner(*args, **kwargs)
        if any(_is_kv_cache(a) for a in (*args, *kwargs.values())):
            warnings.warn(
                "activation checkpointing drops the KV cache passed to a block (the backward "
                "replay would write it twice); pass use_cache=False when training",
                stacklevel=4,  # past nn.Module's call machinery, to the caller
            )
            args = tuple(None if _is_kv_cache(a) else a for a in args)
            kwargs = {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()}
            kwargs.update((k, False) for k in _CACHE_KWARGS if kwargs.get(k))
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` has wrapped ``module``."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> int:
    """Recompute each block's activations in backward; returns how many blocks were newly wrapped.

    Idempotent: blocks already wrapped are left alone and not counted, so a second call returns 0.
    Only effective while gradients are enabled; under ``torch.no_grad()`` a block runs as is.
    """
    wrapped = 0
    for block in blocks:
        if is_checkpointed(block):
            continue
        block.forward = _CheckpointedForward(block.forward, block.__dict__.get("forward"))
        wrapped += 1
    return wrapped


def remove_activation_checkpointing(blocks: Iterable[nn.Module]) -> int:
    """Undo ``apply_activation_checkpointing``; returns how many blocks were unwrapped."""
    removed = 0
    for block in blocks:
        if not is_checkpointed(block):
            continue
        wrapper: _CheckpointedForward = block.__dict__["forward"]
        if wrapper.restore is None:
            del block.forward
        else:
            block.forward = wrapper.restore
        removed += 1
    return removed


def check(state: ParallelState, model: nn.Module) -> str | None:
    """Checkpointing needs blocks to wrap: the policy must find them."""
    if state.ctx.plan.activation_checkpointing and not state.blocks:
        return (f"activation_checkpointing: the {state.policy.name} policy found no transformer "
                "blocks in this model; turn it off or pass a policy")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    """The applier (third in ``parallelize``'s order): wrap the policy's blocks."""
    if state.ctx.plan.activation_checkpointing:
        apply_activation_checkpointing(state.blocks)
        state.applied.append("activation_checkpointing")
    return model
