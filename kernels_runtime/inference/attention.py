"""Attention over the paged KV cache, inside an unchanged HF model.

Every HF attention module computes its queries, keys and values (RoPE applied) and hands them
to ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``; sequence parallelism replaces the
softmax there too (``parallel/sequence/hf_attention.py``). During an engine step the model's
config names ``paged_attention``, which writes the step's new keys and values into their cache
slots and attends each query over its own sequence's slots, so the model's projections, norms,
RoPE and MLPs run unchanged on the flat row of tokens (``batch.py``). Transformers builds no
mask for an attention function it has no mask function for, so no (T, T) mask is ever made.

Decodes attend together in one ``scaled_dot_product_attention`` call over their padded slot
tables; prompt chunks one by one (a fresh prompt causally over itself, a later chunk over the
cache before it and itself). Grouped key/value heads are repeated per query group, as HF does.
Outside an engine step the model's own implementation runs (``paged`` restores it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

from kernels_runtime.inference.batch import StepBatch
from kernels_runtime.inference.kv_cache import PagedKVCache

ATTENTION_NAME = "colossal_paged"
ATTRIBUTE = "paged_layer"


@dataclass
class PagedLayer:
    cache: PagedKVCache
    index: int  # this layer's place in the cache (this rank's layers, in order)
    batch: StepBatch | None = None


def _heads(t: Tensor, groups: int) -> Tensor:
    """(..., Hkv, L, d) -> (..., Hkv * groups, L, d), each key/value head beside its queries."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def paged_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """query (1, H, T, d), key/value (1, Hkv, T, d) of the step's T new tokens ->
    (1, T, H, d), as transformers' attention functions return it."""
    layer: PagedLayer | None = module.__dict__.get(ATTRIBUTE)
    if layer is None or layer.batch is None:
        raise RuntimeError("paged attention runs only inside an inference engine step")
    batch = layer.batch
    cache_k, cache_v = layer.cache.flat(layer.index)  # (slots, Hkv, d)
    cache_k[batch.slots] = key[0].transpose(0, 1).to(cache_k.dtype)  # (T, Hkv, d)
    cache_v[batch.slots] = value[0].transpose(0, 1).to(cache_v.dtype)
    heads, d = query.shape[1], query.shape[3]
    groups = heads // key.shape[1]
    q_all = query[0]  # (H, T, d)
    out = query.new_empty(query.shape[2], heads, d)  # (T, H, d)
    if batch.decode_index is not None:
        q = q_all[:, batch.decode_index].transpose(0, 1).unsqueeze(2)  # (B, H, 1, d)
        k = _heads(cache_k[batch.decode_slots].permute(0, 2, 1, 3), groups)  # (B, H, L, d)
        v = _heads(cache_v[batch.decode_slots].permute(0, 2, 1, 3), groups)
        mask = batch.decode_valid[:, None, None, :]  # (B, 1, 1, L)
        o = sdpa(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling)  # (B, H, 1, d)
        out[batch.decode_index] = o[:, :, 0]
    for chunk in batch.prompts:
        rows = slice(chunk.start, chunk.start + chunk.n)
        q = q_all[:, rows][None]  # (1, H, n, d)
        if chunk.fresh:  # nothing cached before: the chunk's own keys, causally
            k, v = key[:, :, rows], value[:, :, rows]  # (1, Hkv, n, d)
            o = sdpa(q, _heads(k, groups), _heads(v, groups), is_causal=True, scale=scaling)
        else:
            k = _heads(cache_k[chunk.slots].transpose(0, 1), groups)[None]  # (1, H, L, d)
            v = _heads(cache_v[chunk.slots].transpose(0, 1), groups)[None]
            o = sdpa(q, k.to(q.dtype), v.to(q.dtype), attn_mask=chunk.mask[None, None],
                     scale=scaling)
        out[rows] = o[0].transpose(0, 1)  # (n, H, d)
    return out[None], None  # (1, T, H, d)


def install(attention_modules: list[nn.Module], cache: PagedKVCache) -> list[PagedLayer]:
    """Give each of this rank's attention modules its layer of ``cache``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    layers = []
    for index, module in enumerate(attention_modules):
        layer = PagedLayer(cache, index)
        module.__dict__[ATTRIBUTE] = layer
        layers.append(layer)
    return layers


@contextlib.contextmanager
def implementation(config: Any, name: str) -> Iterator[None]:
    """Within the block, the model's attention modules call the function registered as
    ``name``."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def paged(config: Any, layers: list[PagedLayer], batch: StepBatch) -> Iterator[None]:
    """Within the block, the model attends through the cache for ``batch``."""
    for layer in layers:
        layer.batch = batch
    try:
        with implementation(config, ATTENTION_NAME):
            yield
    finally:
        for layer in layers:
            layer.batch = None
