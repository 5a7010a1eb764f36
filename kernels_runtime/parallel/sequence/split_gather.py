"""Megatron sequence parallelism (Korthikanti et al. 2022) inside the tensor-parallel group.

Under 1D tensor parallelism the norms, dropouts and residual adds between the tp regions run
on the whole (b, s, h) activation on every rank: replicated work and memory. Here they run on
this rank's s/tp tokens instead, and the tp boundaries change collective:

    block input (b, s/tp, h) -> norm -> all-gather along s -> (b, s, h) -> column-parallel
    ... row-parallel -> reduce-scatter along s -> (b, s/tp, h) -> residual add

An all-gather plus a reduce-scatter move what one all-reduce moves, so the bytes are the same
as 1D while activations between the regions shrink by tp. The sequence is split entering the
first block and gathered leaving the last (the final norm and the head see all tokens, so
model outputs keep their full shapes); the attention module gathers its input once for q, k
and v, because HF attention reads its sequence length from the hidden states it is given. Every
replicated parameter inside the blocks then sees only this rank's tokens, so its gradient is
summed over tp (``PartialGradModule``); a row-parallel bias too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_runtime.comm.autograd import gather_from_group, scatter_to_group
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.tensor.layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    SharedEntry,
)
from kernels_runtime.parallel.tensor.tensor_parallel import wrap_partial_modules
from kernels_runtime.policies import find_module

COLUMN = (ColumnParallelLinear, ReplicatedHeadsLinear)


def check_length(length: int, parts: int, what: str) -> None:
    """A clear error, raised the same way on every rank before any collective, when the
    sequence does not split into equal shards."""
    if length % parts:
        raise ValueError(
            f"{what} splits the sequence into {parts} equal parts, but its length is "
            f"{length}; pad or cut the batch to a multiple of {parts} "
            f"(e.g. {length + (-length) % parts})")


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    found = kwargs.get("hidden_states")
    return found if isinstance(found, torch.Tensor) else None


def _replace_hidden(args: tuple, kwargs: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (new, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": new}


def apply_split_gather(model: nn.Module, ctx: ParallelContext, blocks: list[nn.Module],
                       blocks_path: str, attention_path: tuple[str, ...]) -> list[tuple[str, str]]:
    """Put the blocks of a tensor-parallel ``model`` on sequence shards (module docstring);
    returns the (module, what it became) lines for the replaced-module table."""
    comm, group, tp = ctx.comm, ctx.group("tp"), ctx.size("tp")
    gather = SharedEntry(lambda x: gather_from_group(  # (b, s/tp, h) -> (b, s, h), once
        x, comm, group, SEQUENCE_DIM, backward="reduce_scatter").contiguous())
    replaced: list[tuple[str, str]] = []
    what = f"sp_mode=split_gather with tp={tp}"

    def gather_attention_input(module: nn.Module, args: tuple, kwargs: dict):
        hidden = _hidden(args, kwargs)
        return None if hidden is None else _replace_hidden(args, kwargs, gather(hidden))

    for i, block in enumerate(blocks):
        prefix = f"{blocks_path}.{i}"
        found = find_module(block, attention_path)
        inside = set()
        if found is not None:
            found[1].register_forward_pre_hook(gather_attention_input, with_kwargs=True)
            inside = {id(m) for m in found[1].modules()}
        for module in block.modules():
            if isinstance(module, COLUMN):
                module.enter = gather
                module.input_gathered = id(module) in inside
            elif isinstance(module, RowParallelLinear):
                module.scatter_output = True
        for path in wrap_partial_modules(block, comm, group):
            replaced.append((f"{prefix}.{path}", "-> PartialGradModule (sequence shards: "
                                                 "gradient summed over tp)"))

    def split_sequence(module: nn.Module, args: tuple, kwargs: dict):
        hidden = _hidden(args, kwargs)
        if hidden is None:
            return None
        check_length(hidden.shape[SEQUENCE_DIM], tp, what)
        return _replace_hidden(args, kwargs, scatter_to_group(hidden, comm, group,
                                                              SEQUENCE_DIM))  # (b, s/tp, h)

    def gather_sequence(module: nn.Module, args: tuple, output: Any):
        if isinstance(output, torch.Tensor):
            return gather_from_group(output, comm, group, SEQUENCE_DIM)  # (b, s, h)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (gather_from_group(output[0], comm, group, SEQUENCE_DIM), *output[1:])
        return output

    def check_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            check_length(ids.shape[-1], tp, what)

    for block in blocks:
        block.register_forward_pre_hook(gather.clear)
    model.register_forward_hook(gather.clear)
    model.register_forward_pre_hook(check_input, with_kwargs=True)
    blocks[0].register_forward_pre_hook(split_sequence, with_kwargs=True)
    blocks[-1].register_forward_hook(gather_sequence)
    return replaced
