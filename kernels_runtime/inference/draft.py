"""Draft-model speculative decoding: a smaller model of the same tokenizer proposes the drafts.

Prompt lookup (``speculation.py``) drafts only where the text repeats itself. A draft model
drafts anywhere: ``Engine(target, draft_model=small)`` makes every request with ``speculate``
on (``SamplingParams``, per request, ``k`` drafts a step) draft its next ``k`` tokens with
``small``, one token-forward of the draft each, before the step; the target verifies them in the
step's forward exactly as it verifies prompt-lookup drafts (the sequence's last token and its
drafts are one chunk over the paged cache, ``k + 1`` logits rows kept). Greedy requests draft the
draft's argmax and keep the longest prefix the target's argmax agrees with, then the target's
own token: the tokens of plain decoding. Sampled requests draft from the draft's distribution
``q`` (the request's temperature, top-k and top-p applied to the draft's logits) and are
verified by rejection sampling against the target's ``p`` (``rejection.py``): each token is
distributed as without speculation. Everything after the drafts (blocks, rollback of rejected
slots, stop tokens inside a step, acceptance counts in the stats, ``/metrics`` and the
dashboard) is prompt lookup's, which this class extends: only the proposal differs.

The draft lives beside the target, whole (never split), with its own KV: an HF
``DynamicCache`` per sequence holding the keys of the tokens it was last fed (``fed``). Before
drafting, the cache is cropped to the longest prefix ``fed`` shares with the sequence's tokens
(rejected drafts, drafts cut by the step's budget, anything) and fed the rest, usually the
accepted drafts' last and the target's token, 1 or 2 tokens: so the rollback to the accepted
length needs no bookkeeping of its own, and a sequence preempted and recomputed keeps its draft
cache (its tokens are kept). A sequence's first draft runs the draft over its whole context.
Caches go when their sequence finishes.

Every rank of a replica drafts, with the same draft weights and the same per-request draft
generator (seeded from the request's seed), so every rank appends the same drafts and holds the
same ``q`` without exchanging anything; acceptance is decided as for prompt lookup (gathered
tensor-parallel logits; under pipelines the last stage's tokens are broadcast). The cost is the
draft's forwards on every rank: drafts are small. The draft's weights must be the same on every
rank: load it from one folder, or build it the same way on every rank (``layer_skip``).
"""

from __future__ import annotations

import copy
import inspect
import os
import time
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels_runtime.inference.sampling import draw, probabilities
from kernels_runtime.inference.scheduler import Scheduler
from kernels_runtime.inference.sequence import FINISHED, Sequence
from kernels_runtime.inference.speculation import PromptLookup

DRAFT_SALT = 0x5EED_D4AF7  # a request's draft generator: its seed xor this


@dataclass
class _DraftCache:
    cache: Any  # transformers.DynamicCache: keys and values of ``fed``
    fed: list[int] = field(default_factory=list)  # the tokens the cache holds, in order
    generator: torch.Generator | None = None  # draws the sampled drafts (None: greedy)


class DraftModel(PromptLookup):
    """Drafts from ``model`` for every running sequence that decodes with ``speculate`` on
    (module docstring); verification, rollback and counts are ``PromptLookup``'s."""

    def __init__(self, scheduler: Scheduler, model: nn.Module, device: torch.device) -> None:
        super().__init__(scheduler)
        self.model, self.device = model, device
        config = model.config
        self.max_len = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None) or 2**31
        self._caches: weakref.WeakKeyDictionary[Sequence, _DraftCache] = \
            weakref.WeakKeyDictionary()
        # the cache's keyword: ``cache`` in transformers >= 5.2x, ``past_key_values`` before
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.forwards = 0  # cumulative draft forwards
        self.seconds = 0.0  # cumulative wall time drafting (the bench's split)

    def draft(self) -> None:
        """Append up to ``k`` drafts (and their ``q`` rows, when sampled) to every running
        sequence decoding with ``speculate`` on."""
        start = time.perf_counter()
        for seq in [s for s in self._caches if s.status == FINISHED]:
            del self._caches[seq]
        for seq in self.running():
            seq.draft_probs = None
            k = seq.params.draft_len
            if not k or seq.to_compute != 1:
                continue
            # never past max_new_tokens (the target adds one after the drafts) nor past the
            # draft's positions
            k = min(k, seq.params.max_new_tokens - len(seq.generated) - 1,
                    self.max_len - len(seq.tokens))
            if k <= 0:
                continue
            tokens, q = self._propose(seq, k)
            seq.tokens += tokens
            seq.drafted, seq.draft_probs = len(tokens), q
        self.seconds += time.perf_counter() - start

    @torch.no_grad()
    def _propose(self, seq: Sequence, k: int) -> tuple[list[int], torch.Tensor | None]:
        """``k`` tokens after ``seq.tokens`` by the draft, and their ``q`` rows (k, V) float64
        when ``seq`` samples (None when greedy)."""
        state = self._caches.get(seq)
        if state is None:
            from transformers import DynamicCache

            gen = None
            if not seq.params.greedy:
                gen = torch.Generator().manual_seed(seq.generator.initial_seed() ^ DRAFT_SALT)
            state = self._caches[seq] = _DraftCache(DynamicCache(), generator=gen)
        tokens = seq.tokens
        keep = _common_prefix(state.fed, tokens, len(tokens) - 1)  # feed at least 1 token
        if keep < len(state.fed):
            state.cache.crop(keep - len(state.fed))  # drop the keys past the shared prefix
            del state.fed[keep:]
        feed, out, rows = tokens[keep:], [], []
        for _ in range(k):
            at = len(state.fed)
            ids = torch.tensor([feed], device=self.device)  # (1, n)
            positions = torch.arange(at, at + len(feed), device=self.device)[None]  # (1, n)
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                                logits_to_keep=1, **{self._cache_arg: state.cache}
                                ).logits[0, -1].float()  # (V,)
            self.forwards += 1
            state.fed += feed
            if seq.params.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits, seq.params)  # (V,) float64
                token = draw(q, state.generator)
                rows.append(q.cpu())
            out.append(token)
            feed = [token]
        return out, torch.stack(rows) if rows else None

    def release(self) -> None:
        super().release()
        for seq in self.running():
            seq.draft_probs = None

    def held(self) -> int:
        """Draft caches held now (for tests: finished sequences leave none behind)."""
        return len(self._caches)


def _common_prefix(a: list[int], b: list[int], most: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``most``."""
    n = min(len(a), len(b), most)
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


# ---- making and checking a draft ------------------------------------------------------------
def load_draft(draft: nn.Module | str | os.PathLike, vocab: int, device: torch.device,
               dtype: torch.dtype) -> nn.Module:
    """The draft model, in eval mode on ``device``: ``draft`` itself, or loaded from its
    ``save_pretrained`` folder in ``dtype``. Refused unless it is an HF causal LM over the
    target's vocabulary of ``vocab`` tokens."""
    if isinstance(draft, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype)
    if not isinstance(draft, nn.Module) or getattr(draft, "config", None) is None \
            or not hasattr(draft, "get_output_embeddings"):
        raise TypeError(f"draft_model must be a transformers causal LM (a PreTrainedModel with "
                        f"a config, or its save_pretrained folder), got {type(draft).__name__}")
    head = draft.get_output_embeddings()
    theirs = int(getattr(draft.config, "vocab_size", None) or head.weight.shape[0])
    if theirs != vocab:
        raise ValueError(f"the draft model's vocabulary has {theirs} tokens but the target's has "
                         f"{vocab}: a draft must use the target's tokenizer (token ids mean the "
                         "same to both); pick a draft of the same family and tokenizer, e.g. "
                         "layer_skip(target, n), or turn speculation to prompt lookup by "
                         "leaving draft_model out")
    return draft.to(device).eval()


def speculator(scheduler: Scheduler, draft_model: nn.Module | str | os.PathLike | None,
               vocab: int, device: torch.device, dtype: torch.dtype) -> PromptLookup:
    """The engine's drafter: prompt lookup, or ``draft_model``'s (checked by ``load_draft``)."""
    if draft_model is None:
        return PromptLookup(scheduler)
    return DraftModel(scheduler, load_draft(draft_model, vocab, device, dtype), device)


def layer_skip(model: nn.Module, layers: int | Seq[int]) -> nn.Module:
    """A draft made of some of ``model``'s decoder layers, its final norm and its head
    (self-speculation by layer skipping): ``layers`` = n keeps the first n, a list keeps those
    (in order; skipping middle layers keeps the early and late ones, which usually agrees with
    the whole model far more often than its first layers alone). A copy, ``model`` untouched.
    For LLaMA-family models (``model.model.layers``) and GPT-2 (``model.transformer.h``). Make
    it before the model is given to an ``Engine`` (which splits and places its weights)."""
    from kernels_runtime.parallel.state import parallel_state

    if parallel_state(model) is not None:
        raise ValueError("layer_skip copies the whole model's layers, but this model was "
                         "already parallelized (given to an Engine or parallelize): make the "
                         "draft first, draft = layer_skip(model, n), then Engine(model, "
                         "draft_model=draft)")
    owner, attr = _decoder_layers(model)
    full = getattr(owner, attr)
    keep = list(range(layers)) if isinstance(layers, int) else list(layers)
    if not keep or any(not 0 <= i < len(full) for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"layers must be a count in [1, {len(full)}] or distinct indices of "
                         f"the model's {len(full)} decoder layers, got {layers!r}")
    setattr(owner, attr, nn.ModuleList([full[i] for i in keep]))
    try:
        draft = copy.deepcopy(model)  # copies only the kept layers
    finally:
        setattr(owner, attr, full)
    for index, layer in enumerate(getattr(_decoder_layers(draft)[0], attr)):
        for module in layer.modules():  # the draft's cache holds its layers 0 .. n-1
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = index
    config = draft.config
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            setattr(config, name, len(keep))
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in keep]
    return draft.eval()


def _decoder_layers(model: nn.Module) -> tuple[nn.Module, str]:
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner, "layers"
    inner = getattr(model, "transformer", None)
    if inner is not None and isinstance(getattr(inner, "h", None), nn.ModuleList):
        return inner, "h"
    raise TypeError(f"layer_skip reads the decoder layers of LLaMA-family models "
                    f"(model.model.layers) and GPT-2 (model.transformer.h); "
                    f"{type(model).__name__} has neither")
