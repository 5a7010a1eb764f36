"""Picking each request's next token from its logits, and deciding whether it stops there.

Each request samples with its own ``torch.Generator`` (seeded from ``SamplingParams.seed``), one
draw per token, so what it gets depends on its own logits only: not on the other requests in the
batch, the order they arrived in, or the plan the model runs under.
"""

from __future__ import annotations

import torch

from kernels_runtime.inference.params import SamplingParams
from kernels_runtime.inference.sequence import Sequence


def new_generator(params: SamplingParams, fallback: torch.Generator) -> torch.Generator | None:
    """The request's generator: seeded by its seed, else by a draw from the engine's own
    (itself seeded), so unseeded requests are random but a rerun repeats them. None: greedy."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int(
        torch.randint(0, 2**62, (), generator=fallback))
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits (S, V) float32 -> one token per sequence."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, seq in enumerate(seqs):
        if seq.params.greedy:
            out.append(greedy[i])
            continue
        out.append(draw(probabilities(logits[i], seq.params), seq.generator))
    return out


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row of logits (V,) -> the distribution a sampled request draws from (V,) float64:
    divided by the temperature, cut to ``top_k`` and to ``top_p``."""
    row = logits.double()
    # shifted to a max of 0 before dividing: a tiny temperature (5e-324 is a valid JSON
    # number) then makes the others -inf and the argmax 0, never inf - inf = nan
    row = (row - row.max()) / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered  # mass of the tokens ranked above each
        ordered = ordered.masked_fill(before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (V,): one draw of ``generator`` per token, whatever the
    step (speculative verification draws exactly as plain decoding does)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def stop_check(seq: Sequence, token: int, eos: set[int], tokenizer) -> tuple[str, object] | None:
    """(finish reason, what stopped it) once ``token`` was appended, else None; cuts the text
    before a stop string."""
    p = seq.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos):
        return "stop", token
    out = seq.output
    if tokenizer is not None and p.stop_strings:
        text = out.text or ""  # the whole text: decoding a new byte can change the last char
        found = [(at, s) for s in p.stop_strings if (at := text.find(s)) >= 0]
        if found:
            at, s = min(found)
            out.text = text[:at]
            return "stop", s
    if len(seq.generated) >= p.max_new_tokens:
        return "length", None
    return None
