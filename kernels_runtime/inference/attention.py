"""Attention over the paged KV cache, inside an unchanged HF model.

Every HF attention module computes its queries, keys and values (RoPE applied) and hands them
to ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``; sequence parallelism replaces the
softmax there too (``parallel/sequence/hf_attention.py``). During an engine step the model's
config names ``paged_attention``, which writes the step's new keys and values into their cache
slots and attends each query over its own sequence's slots, so the model's projections, norms,
RoPE and MLPs run unchanged on the flat row of tokens (``batch.py``). Transformers builds no
mask for an attention function it has no mask function for, so no (T, T) mask is ever made.

Decoders outside transformers that call ``scaled_dot_product_attention(..., is_causal=True)``
(what the generic policy covers) are routed the same way by ``SdpaLayers``, a torch function
mode that takes the n-th call of a forward as layer n's attention.

Each sequence attends on its own (``scaled_dot_product_attention`` per span): a sequence whose
blocks are consecutive reads its keys as a slice of the cache, in place; gathering a padded
batch of every sequence's keys instead costs about nine times as much on a CPU (measured: 8 ms
against 0.9 ms for 16 sequences of 100-900 tokens, 4 heads of 64). Grouped key/value heads are
never repeated: a key/value head's query heads are stacked into one query. Outside an engine
step the model's own implementation runs (``paged`` restores it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.overrides import TorchFunctionMode

from kernels_runtime.inference.batch import StepBatch
from kernels_runtime.inference.kv_cache import PagedKVCache

ATTENTION_NAME = "colossal_paged"
ATTRIBUTE = "paged_layer"


@dataclass
class PagedLayer:
    cache: PagedKVCache
    index: int  # this layer's place in the cache (this rank's layers, in order)
    batch: StepBatch | None = None


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
            scale: float | None) -> Tensor:
    """q (H, n, d) over k, v (Hkv, L, d) -> (H, n, d). Grouped heads: each key/value head's
    query heads are stacked as rows of one query, (Hkv, g*n, d), so keys are never repeated."""
    heads, n, d = q.shape
    groups = heads // k.shape[0]
    if groups > 1:
        q = q.reshape(k.shape[0], groups * n, d)  # heads h*g .. h*g+g-1 share key/value head h
        mask = None if mask is None else mask.repeat(groups, 1)  # (g*n, L)
    o = sdpa(q[None], k[None].to(q.dtype), v[None].to(q.dtype),
             attn_mask=None if mask is None else mask[None, None], scale=scale)
    return o[0].reshape(heads, n, d)


def paged_core(layer: PagedLayer, query: Tensor, key: Tensor, value: Tensor,
               scaling: float | None) -> Tensor:
    """Write the step's keys and values into ``layer``'s cache and attend every sequence over
    its own: query (1, H, T, d), key/value (1, Hkv, T, d) -> (H, T, d)."""
    batch = layer.batch
    if batch is None:
        raise RuntimeError("paged attention runs only inside an inference engine step")
    cache_k, cache_v = layer.cache.layer(layer.index)  # (Hkv, slots, d)
    cache_k.index_copy_(1, batch.slots, key[0].to(cache_k.dtype))  # the step's new (Hkv, T, d)
    cache_v.index_copy_(1, batch.slots, value[0].to(cache_v.dtype))
    q_all = query[0]  # (H, T, d)
    parts = []
    for span in batch.spans:  # in row order: their outputs concatenate to the step's rows
        if span.first_slot is not None:  # consecutive blocks: a view, read in place
            keys = slice(span.first_slot, span.first_slot + span.length)
            k, v = cache_k[:, keys], cache_v[:, keys]
        else:  # index_select: a third of advanced indexing's cost on a CPU (measured)
            k, v = cache_k.index_select(1, span.slots), cache_v.index_select(1, span.slots)
        parts.append(_attend(q_all[:, span.rows], k, v, span.mask, scaling))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (H, T, d)


def paged_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention function: query (1, H, T, d), key/value (1, Hkv, T, d) of the
    step's T new tokens -> (1, T, H, d)."""
    layer: PagedLayer | None = module.__dict__.get(ATTRIBUTE)
    if layer is None:
        raise RuntimeError("paged attention runs only inside an inference engine step")
    return paged_core(layer, query, key, value, scaling).transpose(0, 1)[None], None


class SdpaLayers(TorchFunctionMode):
    """For decoders outside transformers (the generic policy's): within the mode, the n-th
    call to ``scaled_dot_product_attention`` of a forward is layer n's attention and goes to
    ``handler(n, query, key, value, scale)``, which returns what SDPA would, (b, H, s, d)."""

    def __init__(self, handler: Callable[..., Tensor]) -> None:
        super().__init__()
        self.handler, self.calls = handler, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not sdpa:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        if kwargs.get("attn_mask") is not None or not kwargs.get("is_causal", False):
            raise TypeError("a decoder served by the engine calls scaled_dot_product_attention"
                            " with is_causal=True and no attn_mask (the engine supplies the "
                            "causal structure of every request)")
        index, self.calls = self.calls, self.calls + 1
        return self.handler(index, query, key, value, kwargs.get("scale"))


def install(attention_modules: list[nn.Module], cache: PagedKVCache) -> list[PagedLayer]:
    """Give each of this rank's attention modules its layer of ``cache``."""
    from transformers import AttentionInterface

    # out of any torch.compile graph (``compiled.py``): traced, its loop over the step's
    # sequences would specialise on each batch and recompile; eager, the wrapper costs 0.4 us
    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(paged_attention))
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
    """Within the block, the model attends through the cache for ``batch`` (an HF model via
    its config, a generic decoder via ``SdpaLayers``)."""
    for layer in layers:
        layer.batch = batch
    try:
        if config is None:
            def handler(i: int, q: Tensor, k: Tensor, v: Tensor, scale: Any) -> Tensor:
                return paged_core(layers[i], q, k, v, scale)[None]  # (1, H, T, d)

            with SdpaLayers(handler):
                yield
        else:
            with implementation(config, ATTENTION_NAME):
                yield
    finally:
        for layer in layers:
            layer.batch = None
