"""Sequence-parallel attention inside an HF model, through transformers' attention interface.

Every HF attention module computes its own q, k, v and hands them, with (b, H, s, d) shapes, to
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. Registering one function there and
pointing the model's config at it lets ring attention or Ulysses replace the softmax without
touching the model's code: the projections, RoPE and the output projection run on this rank's
tokens as usual, and only this function talks to the other sp ranks. It needs what the model
no longer has after its input was split: every rank's global positions and the whole padding
mask (``SequenceShard``, refreshed by ``shard_inputs`` for each forward). Transformers builds
no mask for an attention function it has no mask function for, so the model's own (per-shard)
mask never reaches here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kernels_runtime.parallel.sequence.ring_attention import RingPlan, plan_ring, ring_attention
from kernels_runtime.parallel.sequence.ulysses import ulysses_attention

ATTENTION_NAME = "colossal_sequence_parallel"
ATTRIBUTE = "sequence_shard"


@dataclass
class SequenceShard:
    """This rank's part of the sequence for the current forward (shared by every layer)."""

    mode: str  # "ring" or "all_to_all"
    comm: Any
    group: Any
    causal: bool
    positions: Tensor | None = None  # (s/sp,) global positions of this rank's tokens
    every: list[Tensor] | None = None  # every rank's positions, in rank order (host)
    valid: Tensor | None = None  # (b, s) bool, True for real tokens; None: no padding
    rank: int = 0
    ring_plan: RingPlan | None = None  # built by the first layer of each forward
    join: bool = True  # False: outputs stay this rank's tokens (a loss computed on shards)

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Within the block the model's outputs are this rank's tokens, (b, s/sp, ...)."""
        previous, self.join = self.join, False
        try:
            yield
        finally:
            self.join = previous


def _full_mask(shard: SequenceShard, length: int, dtype: torch.dtype,
               device: torch.device) -> Tensor | None:
    """An additive (b, 1, s, s) mask over the whole sequence (contiguous order), as transformers
    builds it: the dtype's minimum where a key is hidden, so no row is all -inf."""
    if shard.valid is None and shard.causal:
        return None  # is_causal
    allowed = torch.ones(1, 1, length, length, dtype=torch.bool, device=device)
    if shard.causal:
        allowed = allowed.tril()
    if shard.valid is not None:
        allowed = allowed & shard.valid.to(device)[:, None, None, :]  # (b, 1, s, s)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def sequence_parallel_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """query (b, H, s/sp, d), key/value (b, Hkv, s/sp, d) -> (b, s/sp, H, d), as transformers'
    attention functions return it."""
    shard: SequenceShard = module.__dict__[ATTRIBUTE]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if shard.mode == "ring":
        if dropout:
            raise ValueError("sp_mode=ring has no attention dropout: set the model's attention "
                             "dropout to 0 (e.g. attn_pdrop=0.0) or use sp_mode=all_to_all")
        if shard.ring_plan is None:  # once per forward: every layer has the same layout
            shard.ring_plan = plan_ring(shard.every, shard.valid, shard.causal, shard.rank,
                                        query.device)
        out = ring_attention(query, key, value, q_positions=shard.positions,
                             k_positions=shard.positions, key_valid=None, causal=shard.causal,
                             scale=scale, comm=shard.comm, group=shard.group,
                             plan=shard.ring_plan)
    else:
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (b, H/sp, s, d)
            mask = _full_mask(shard, q.shape[2], q.dtype, q.device)
            return nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        out = ulysses_attention(query, key, value, attend, shard.comm, shard.group)
    return out.transpose(1, 2).contiguous(), None  # (b, s/sp, H, d)


def install(model: nn.Module, attention_modules: list[nn.Module], shard: SequenceShard) -> None:
    """Route every attention module of ``model`` through ``sequence_parallel_attention``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, sequence_parallel_attention)
    model.config._attn_implementation = ATTENTION_NAME
    for module in attention_modules:
        module.__dict__[ATTRIBUTE] = shard
