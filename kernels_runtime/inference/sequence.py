"""One request while it runs: its tokens, how many have their keys and values in the cache, and
the blocks that hold them.

``tokens`` is the prompt followed by every generated token. ``computed`` counts the tokens whose
keys and values are in the cache; the scheduler moves it forward a chunk at a time (a long
prompt over several steps, then one token per step). Preemption by recompute sets it back to 0
and keeps the tokens: the sequence comes back as a longer prompt and continues exactly where it
stopped. A step samples a new token only when its chunk reaches the end of ``tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kernels_runtime.inference.params import RequestOutput, SamplingParams

WAITING, RUNNING, SWAPPED, FINISHED = "waiting", "running", "swapped", "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    computed: int = 0  # tokens whose keys/values are in the cache
    blocks: list[int] = field(default_factory=list)  # block table: logical -> physical block
    hashes: list[int] = field(default_factory=list)  # prefix key of each full block so far
    status: str = WAITING
    generator: Any = None  # the request's own torch.Generator (sampling with a seed)
    swapped_out: Any = None  # host copies of its blocks while swapped (this rank's layers)
    swapped_out_blocks: list[int] = field(default_factory=list)  # the blocks they came from
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens found in shared blocks (not computed)
    drafted: int = 0  # the last ``drafted`` tokens are speculative drafts (speculation.py)
    draft_probs: Any = None  # (>= drafted, V) the draft model's q of each draft (draft.py)
    adapter: int = -1  # the slot of its LoRA adapter (adapters.py); -1: the base model
    output: RequestOutput = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.output is None:
            self.output = RequestOutput(self.request_id, list(self.tokens[:self.prompt_len]))

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def to_compute(self) -> int:
        """Tokens still without keys and values in the cache (a prompt's rest, or the last
        sampled token)."""
        return len(self.tokens) - self.computed

    @property
    def in_prefill(self) -> bool:
        return self.to_compute > 1

    @property
    def prefix_root(self) -> int:
        """The key its first block's prefix hash starts from: the same tokens under another
        adapter have other keys and values, so they must never share blocks."""
        return 0 if self.adapter < 0 else hash(("adapter", self.adapter))

    def total_len_bound(self) -> int:
        """The most tokens this request can ever hold in the cache."""
        return self.prompt_len + self.params.max_new_tokens
