"""What a request asks for (``SamplingParams``) and what it gets back (``RequestOutput``).

A request's parameters are checked when it is added, not when it runs: a bad request becomes a
finished output carrying ``error`` (what is wrong and how to fix it) while the other requests of
the same call run as if it had never been sent. Nothing about a bad request is raised, so one
malformed prompt in a batch of 64 never costs the other 63 their answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("length", "stop", "abort", "error")
SEED_MAX = 2**63 - 1
DEFAULT_DRAFT = 4  # tokens drafted per step under ``speculate=True`` (speculation.py)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` is greedy (the argmax); above it, logits are divided by the temperature,
    cut to the ``top_k`` most likely (0: all) and to the smallest set whose probability reaches
    ``top_p``, then sampled from a generator seeded with ``seed``, which is the request's own,
    so its tokens do not depend on what else is in the batch or on the plan. Generation stops
    after ``max_new_tokens``, at a token in ``stop_token_ids`` (and the model's end-of-sequence
    token unless ``ignore_eos``) or where the text first contains one of ``stop`` (the text is
    cut before it; needs a tokenizer). ``return_logits`` keeps each generated token's logits
    (float32, the whole vocabulary), for tests and inspection.

    ``speculate`` turns on speculative decoding for this request: prompt lookup, or the
    engine's ``draft_model`` when it has one (``True``: draft up to ``DEFAULT_DRAFT`` tokens a
    step; an integer: up to that many; ``False``/0: off). Greedy tokens are exactly those
    without it, only fewer forwards compute them; sampled ones are verified by rejection
    sampling, which keeps the distribution. Under prompt lookup it also draws the generator as
    plain decoding does, so a seed gives the same tokens either way (up to float noise between
    logits computed in one chunk and one token at a time); under a draft model a seed gives
    tokens of the same distribution, not the same tokens (``rejection.py``).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] | tuple[int, ...] = ()
    stop: str | list[str] | tuple[str, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False
    speculate: bool | int = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def draft_len(self) -> int:
        """Tokens drafted per step: 0 when speculation is off."""
        if self.speculate is True:
            return DEFAULT_DRAFT
        return int(self.speculate or 0)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def problem(self, has_tokenizer: bool) -> str | None:
        """What is wrong with these parameters, or None."""
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            return f"max_new_tokens must be a positive integer, got {n!r}"
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            return (f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}"
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            return f"top_p must be in (0, 1], got {p!r}"
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            return f"seed must be an integer or None, got {self.seed!r}"
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            # torch's manual_seed raises past 64 bits; a signed 64-bit range as OpenAI's
            return f"seed must be in [0, {SEED_MAX}] (2**63 - 1), got {self.seed}"
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0
                for i in _iterable(self.stop_token_ids)):
            return ("stop_token_ids must be a list of token ids (integers >= 0), got "
                    f"{self.stop_token_ids!r}")
        if not isinstance(self.stop, str) and not (
                isinstance(self.stop, (list, tuple))
                and all(isinstance(s, str) for s in self.stop)):
            return (f"stop must be a string or a list of strings, got "
                    f"{type(self.stop).__name__} {self.stop!r}; stop on token ids with "
                    "stop_token_ids=[...]")
        if any(s == "" for s in self.stop_strings):
            return "stop strings must not be empty"
        k = self.speculate
        if not isinstance(k, (bool, int)) or (not isinstance(k, bool) and k < 0):
            return (f"speculate must be True, False or a number of draft tokens >= 0, got "
                    f"{k!r}")
        if self.stop_strings and not has_tokenizer:
            return ("stop strings need a tokenizer to read the text: pass tokenizer= to the "
                    "Engine, or stop on token ids with stop_token_ids=[...]")
        return None


def _iterable(value: Any) -> list:
    try:
        return list(value)
    except TypeError:
        return [value, None]  # not iterable: fails the element check


@dataclass
class RequestOutput:
    """One request's result so far (``finished``) or in full.

    ``token_ids`` are the generated tokens (a stop token included, as HF ``generate`` keeps
    it); ``text`` their decoding when the engine has a tokenizer (cut before a stop string);
    ``finish_reason`` one of ``length``, ``stop``, ``abort``, ``error``; ``error`` says what
    was wrong with a request that could not run. Timings are seconds since the request was
    added: ``first_token_s`` (time to first token) and ``finished_s``; ``token_times_s`` the
    time of every generated token.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logits: list[Any] | None = None  # one (vocab,) float32 tensor per token (return_logits)
    first_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def per_token_s(self) -> float | None:
        """Mean time between generated tokens after the first (time per output token)."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
