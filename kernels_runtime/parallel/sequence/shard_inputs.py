"""Splitting an HF model's input over the sp ranks, and joining the sequence after the blocks.

Everything in a transformer but attention works token by token, so under sp each rank runs the
embeddings and blocks on its own tokens: ``input_ids`` (and ``token_type_ids``, given
``position_ids``, ``inputs_embeds``) are cut by this rank's global positions, contiguous for
Ulysses and zig-zag for ring attention (an early and a late chunk, so causal work is even). The
positions go in as ``position_ids``, so learned position embeddings and RoPE see the true
offsets; the padding mask is taken out whole for the attention function (``hf_attention``).
The module holding the blocks (GPT-2's ``transformer``, LLaMA's ``model``, BERT's ``encoder``)
all-gathers its output back into sequence order (after the final norm, which works per token:
GPT-2 reshapes by its input's shape right after it), so the head, a pooler and the model's
outputs (and an HF loss from ``labels``) are what the unsplit model gives. The gather's
backward keeps each rank's tokens' gradient, times sp: data parallelism treats the sp ranks as
replicas and averages their gradients, which makes the sequence-split part's the sum over
ranks and the replicated part's (the head, computed whole on every rank) its own value.
Per-layer ``hidden_states`` stay shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_runtime.comm.autograd import gather_from_group
from kernels_runtime.parallel.sequence.hf_attention import SequenceShard
from kernels_runtime.parallel.sequence.zigzag import contiguous_positions, zigzag_positions

SEQUENCE_DIM = 1
SPLIT_KEYS = ("input_ids", "token_type_ids", "position_ids", "inputs_embeds")


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.factor, None


def layout_positions(mode: str, length: int, rank: int, sp: int) -> torch.Tensor:
    """Global positions of rank's tokens: zig-zag under ring attention, contiguous otherwise;
    a clear error (naming the lengths that work) when the length does not split."""
    try:
        if mode == "ring":
            return zigzag_positions(length, rank, sp)
        return contiguous_positions(length, rank, sp)
    except ValueError as err:
        raise ValueError(f"sp_mode={mode} with sp={sp}: {err}") from None


def register(model: nn.Module, body: nn.Module, shard: SequenceShard, rank: int,
             sp: int) -> None:
    """Hooks on ``model`` (split its input) and on ``body``, the module holding the blocks
    (join the sequence)."""
    order: dict[int, torch.Tensor] = {}  # sequence length -> inverse of the gathered order

    def split(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        if args:  # the first positional argument is input_ids in every HF model we split
            kwargs.setdefault("input_ids", args[0])
            args = args[1:]
        first = kwargs.get("input_ids")
        if first is None:
            first = kwargs.get("inputs_embeds")
        if first is None:
            raise ValueError(f"sp_mode={shard.mode}: the model got neither input_ids nor "
                             "inputs_embeds to split over the sequence")
        batch, length = first.shape[0], first.shape[SEQUENCE_DIM]
        positions = layout_positions(shard.mode, length, rank, sp)  # (s/sp,)
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and shard.mode == "all_to_all" and bool(mask.all()):
            mask = None  # Ulysses' sdpa then runs its causal kernel, no (s, s) mask (a host
            # read of the mask, once per forward)
        shard.valid = None if mask is None else mask.bool()  # (b, s)
        shard.positions, shard.rank, shard.ring_plan = positions, rank, None
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = torch.arange(length, device=first.device).expand(
                batch, -1)  # (b, s)
        for key in SPLIT_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor):
                kwargs[key] = value.index_select(SEQUENCE_DIM, positions.to(value.device))
        kwargs["use_cache"] = False  # a cache of one shard's keys serves no later call
        shard.every = [layout_positions(shard.mode, length, r, sp) for r in range(sp)]
        if length not in order:  # gathered order -> sequence order
            order[length] = torch.argsort(torch.cat(shard.every))
        return args, kwargs

    def whole(hidden: torch.Tensor) -> torch.Tensor:  # (b, s/sp, h) -> (b, s, h)
        gathered = gather_from_group(_ScaleGrad.apply(hidden, float(sp)), shard.comm,
                                     shard.group, SEQUENCE_DIM)
        inverse = order[gathered.shape[SEQUENCE_DIM]].to(gathered.device)
        return gathered.index_select(SEQUENCE_DIM, inverse)  # sequence order

    def join(module: nn.Module, args: tuple, output: Any) -> Any:
        if not shard.join:
            return output
        if isinstance(output, torch.Tensor):
            return whole(output)
        if getattr(output, "last_hidden_state", None) is not None:
            output.last_hidden_state = whole(output.last_hidden_state)
            return output
        if isinstance(output, tuple):
            return (whole(output[0]), *output[1:])
        raise TypeError(f"sp_mode={shard.mode}: cannot find the hidden states in "
                        f"{type(module).__name__}'s output ({type(output).__name__})")

    model.register_forward_pre_hook(split, with_kwargs=True)
    body.register_forward_hook(join)
