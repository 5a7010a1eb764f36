"""Turning what a caller sends into a ``Sequence``, or into a clear per-request error.

Every check a request can fail is made here, when it is added, so a bad request never reaches
the scheduler: it becomes a finished ``RequestOutput`` with ``finish_reason="error"`` and an
``error`` that says what is wrong and how to fix it.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_runtime.inference.params import SamplingParams


class RequestError(ValueError):
    """A request that cannot run; the message is the request's ``error``."""


def prompt_ids(prompt: Any, tokenizer: Any, vocab: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("the prompt is text but the engine has no tokenizer: pass "
                               "Engine(..., tokenizer=...) or give the prompt as token ids")
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise RequestError(f"a prompt tensor must be 1-D token ids, got {prompt.dtype} of "
                               f"shape {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            raise RequestError("a prompt is text or a list of token ids (integers); got a "
                               f"list holding {sorted({type(i).__name__ for i in prompt})}")
        ids = list(prompt)
    else:
        raise RequestError(f"a prompt is text or a list of token ids, got "
                           f"{type(prompt).__name__}")
    if not ids:
        raise RequestError("the prompt is empty: give at least one token")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    return ids


def check_fits(n_prompt: int, params: SamplingParams, max_model_len: int, block_size: int,
               num_blocks: int, kv_mem: int) -> None:
    if n_prompt >= max_model_len:
        raise RequestError(f"the prompt has {n_prompt} tokens but the model's context holds "
                           f"{max_model_len}, with room for at least one new token: shorten "
                           f"it to at most {max_model_len - 1} tokens")
    total = n_prompt + params.max_new_tokens
    if total > max_model_len:
        raise RequestError(f"the prompt ({n_prompt} tokens) and max_new_tokens "
                           f"({params.max_new_tokens}) exceed the model's context of "
                           f"{max_model_len} tokens: lower max_new_tokens to at most "
                           f"{max_model_len - n_prompt}")
    blocks = -(-(total - 1) // block_size)  # the last token is never cached
    if blocks > num_blocks:
        from kernels_runtime.byte_sizes import human_bytes

        raise RequestError(f"this request can hold up to {total - 1} tokens in the KV cache, "
                           f"{blocks} blocks of {block_size}, but the cache has {num_blocks} "
                           f"blocks (kv_mem={human_bytes(kv_mem)}): raise kv_mem or lower "
                           "max_new_tokens")


def check_params(params: Any, has_tokenizer: bool) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling parameters must be a SamplingParams, got "
                           f"{type(params).__name__}")
    problem = params.problem(has_tokenizer)
    if problem:
        raise RequestError(problem)
    return params


def prompt_ids_or_empty(prompt: Any, tokenizer: Any) -> list[int]:
    """The prompt's ids where they can be read (for a rejected request's output)."""
    try:
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt)) if tokenizer is not None else []
        if isinstance(prompt, torch.Tensor):
            return [int(i) for i in prompt.flatten().tolist()]
        return [i for i in prompt if isinstance(i, int)]
    except Exception:  # noqa: BLE001 - a rejected request's echo is best effort
        return []
