"""Prompt-lookup speculative decoding: draft tokens by copying, verify them in one forward.

A decode step computes one token per sequence, and on a CPU or a small batch its cost is mostly
reading the weights, not the arithmetic: a forward over 5 tokens of one sequence costs little
more than over 1. When the output repeats its input (code being edited, a summary quoting its
source, a chat turn restating the question) the next tokens can be guessed without a model:
find the last ``n`` tokens earlier in prompt + output (``n`` from ``MAX_NGRAM`` down to
``MIN_NGRAM``) and propose the ``k`` that followed them there (prompt lookup decoding, Saxena
2023; vLLM's ``ngram`` speculator, whose ``prompt_lookup_min`` is ``MIN_NGRAM``). A single
repeated token is too weak a cue: on ``bench inference``'s repeat-and-edit workload (4 drafts
a step), acceptance rose from 55% to 64% without 1-gram drafts, at the same tokens/s (1.26x
against 1.25x: on a CPU the rows they no longer verify were cheap ones).

Verification reuses the engine's chunked prefill: the sequence's last sampled token and its
``k`` drafts are one chunk of ``k + 1`` tokens (``seq.drafted`` marks the drafts at the end of
``seq.tokens``), and logits are kept for every one of those rows. Row ``j``'s argmax is the
target's token after draft ``j``; the longest prefix of drafts equal to those argmaxes is
accepted, then the target's own token after it, so a step yields 1 to ``k + 1`` tokens, exactly
the greedy tokens of plain decoding. The rejected drafts' keys and values are abandoned: the
sequence's ``computed`` only counts the accepted ones (the slots are written again next step),
and blocks holding nothing but rejected slots go back to the pool.

Sampled requests (``temperature > 0``) verify by rejection sampling (Leviathan et al. 2023;
Chen et al. 2023), which keeps the target's distribution exactly. A prompt-lookup draft is a
deterministic proposal (``q`` one-hot on draft ``x``), so the rule reads: accept ``x`` with
probability ``p(x)``; on a rejection, draw from the residual ``max(0, p - q)`` normalized, that
is ``p`` without ``x``; after ``k`` acceptances, draw a bonus token from the last row.
``verify_sampled`` realizes it with the randomness plain decoding uses: row ``j``'s token is
drawn from ``p_j`` with the request's generator (one draw, as plain decoding draws it), and the
draft is accepted when that token is the draft (probability ``p_j(x)``); otherwise the token
drawn, which is then ``p_j`` conditioned on not being ``x``, i.e. the normalized residual,
is the step's last. Rows past the first rejection draw nothing, so a seeded request consumes
one draw per token with or without speculation and gets the same tokens either way (up to
float noise between a verification chunk's logits and a one-token decode's), whatever else is
in the batch.

A draft model (``draft.py``) proposes instead of ``propose``: the class below with another
``draft``, and a real ``q`` for sampled requests (``rejection.py``).

Every rank of a replica decides the same: drafts come from the sequence's tokens (identical on
every rank) and acceptance from logits every rank holds the same (tensor-parallel logits are
gathered, generators seeded alike; under pipelines the last stage broadcasts its tokens).
"""

from __future__ import annotations

import torch

from kernels_runtime.inference.batch import StepBatch
from kernels_runtime.inference.rejection import verify_with_draft
from kernels_runtime.inference.sampling import draw, probabilities, sample
from kernels_runtime.inference.scheduler import ScheduledStep, Scheduler
from kernels_runtime.inference.sequence import RUNNING, Sequence

MAX_NGRAM = 3  # the longest suffix looked up; shorter ones are tried when it is not found
MIN_NGRAM = 2  # the shortest: no drafts from a match of one token


def propose(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM,
            min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last
    ``n`` tokens, trying ``n = max_ngram`` down to ``min_ngram``; [] when none occurs
    earlier."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n:]
        last = suffix[-1]
        # scan backwards for the suffix's last token, then compare the rest: the latest
        # match is the likeliest to continue as the text does now
        for end in range(size - 2, n - 2, -1):  # end: index of the match's last token
            if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def accepted(draft: list[int], target: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def verify_sampled(logits: torch.Tensor, draft: list[int], seq: Sequence) -> list[int]:
    """Rejection sampling of ``draft`` (k) against ``logits`` (k + 1, V), the rows after the
    last token and after each draft: ``k + 1`` tokens of which the first ``a`` equal the
    accepted drafts and the next is the target's (the residual's, or the bonus); -1 fill the
    rows past it, never drawn (module docstring)."""
    out = []
    for j, x in enumerate(draft + [None]):
        token = draw(probabilities(logits[j], seq.params), seq.generator)
        out.append(token)
        if token != x:  # rejected (token from p without x: the residual), or the bonus
            break
    return out + [-1] * (len(draft) + 1 - len(out))


def target_tokens(logits: torch.Tensor, batch: StepBatch) -> list[int]:
    """The target's token at every kept row (R): after a sequence's drafts, the argmax
    (greedy) or the rejection sampler's (``verify_sampled``; a draft model's drafts:
    ``rejection.py``); at the last row of a sequence without drafts, its sampled token."""
    tokens = logits.argmax(dim=-1).tolist()  # (R,)
    starts = torch.tensor([0] + batch.rows).cumsum(0).tolist()
    plain = [(i, seq) for i, seq in enumerate(batch.sampled) if batch.rows[i] == 1]
    if plain:
        rows = torch.tensor([starts[i] for i, _ in plain], device=logits.device)
        for (i, _), token in zip(plain, sample(logits[rows], [s for _, s in plain])):
            tokens[starts[i]] = token
    for i, seq in enumerate(batch.sampled):
        n = batch.rows[i]
        if n > 1 and not seq.params.greedy:
            draft = seq.tokens[len(seq.tokens) - seq.drafted:]
            rows, q = logits[starts[i]:starts[i] + n], seq.draft_probs  # (k + 1, V), (k, V)
            tokens[starts[i]:starts[i] + n] = verify_sampled(rows, draft, seq) if q is None \
                else verify_with_draft(rows, draft, q, seq)
    return tokens


class PromptLookup:
    """Drafts for a step's decoding sequences, fitted to what the scheduler ran, and settled
    once the target's tokens are known. Counts drafted and accepted tokens for the stats."""

    def __init__(self, scheduler: Scheduler, max_ngram: int = MAX_NGRAM) -> None:
        self.scheduler, self.max_ngram = scheduler, max_ngram
        self.drafted = 0  # cumulative, tokens proposed and verified
        self.accepted = 0  # cumulative, of those the target agreed with
        self.freed_blocks = 0  # cumulative, blocks handed back that held only rejected slots
        self._settled: list[Sequence] = []  # drafted this step, for ``release``

    def running(self) -> list[Sequence]:
        """The sequences drafts are for: the scheduler's running ones (under pipeline overlap,
        those of the group being scheduled, ``pipelined.py``)."""
        return self.scheduler.running

    def draft(self) -> None:
        """Append drafts to every running sequence that decodes with ``speculate`` on."""
        for seq in self.running():
            k = seq.params.draft_len
            if not k or seq.to_compute != 1:
                continue
            # at most what it may still generate, less the target's own token after them:
            # drafting never runs past max_new_tokens
            k = min(k, seq.params.max_new_tokens - len(seq.generated) - 1)
            if k <= 0:
                continue
            draft = propose(seq.tokens, k, self.max_ngram)
            seq.tokens += draft
            seq.drafted = len(draft)

    def fit(self, step: ScheduledStep) -> None:
        """After scheduling: a drafted sequence whose chunk was cut by the step's token budget
        keeps only the drafts its chunk reaches; one not run (preempted, no budget left) drops
        them (a recomputed sequence must not take drafts for its prompt)."""
        ran = dict(step.chunks)
        for seq in list(self.scheduler.running) + step.preempted:
            if seq.drafted:
                keep = max(0, ran.get(seq, 0) - 1) if seq.status == RUNNING else 0
                _drop_drafts(seq, seq.drafted - min(keep, seq.drafted))

    def settle(self, step: ScheduledStep, sampled: list[Sequence],
               targets: list[list[int]]) -> list[list[int]]:
        """Before ``finish_chunks``: every sampled sequence's new tokens (accepted drafts, then
        the target's token), its rejected drafts cut from its tokens and its chunk, so only
        accepted keys count as computed. The accepted drafts stay in ``seq.tokens`` until
        ``finish_chunks`` indexes their blocks; ``release`` then removes them, for the engine
        to append one by one (each checked for a stop)."""
        rejected: dict[Sequence, int] = {}
        out, self._settled = [], []
        for seq, target in zip(sampled, targets):
            k = seq.drafted
            if not k:
                out.append(target[-1:])
                continue
            draft = seq.tokens[len(seq.tokens) - k:]
            a = accepted(draft, target)
            self.drafted += k
            self.accepted += a
            rejected[seq] = k - a
            self._settled.append(seq)
            _drop_drafts(seq, k - a)
            out.append(draft[:a] + [target[a]])
        if rejected:
            step.chunks = [(s, n - rejected.get(s, 0)) for s, n in step.chunks]
        return out

    def release(self) -> None:
        """After ``finish_chunks``: take the accepted drafts out of the tokens again (the engine
        appends them) and free the blocks beyond the computed tokens (rejected slots only)."""
        pool, size = self.scheduler.pool, self.scheduler.block_size
        settled, self._settled = self._settled, []
        for seq in settled:
            _drop_drafts(seq, seq.drafted)
            keep = -(-seq.computed // size)
            self.freed_blocks += len(seq.blocks[keep:])
            pool.release_all(seq.blocks[keep:])
            del seq.blocks[keep:]

    def stats(self) -> dict[str, int | float | None]:
        return {"spec_drafted_tokens": self.drafted, "spec_accepted_tokens": self.accepted,
                "spec_acceptance": self.accepted / self.drafted if self.drafted else None}


def _drop_drafts(seq: Sequence, n: int) -> None:
    """Remove the last ``n`` drafts from ``seq``'s tokens."""
    if n:
        del seq.tokens[len(seq.tokens) - n:]
        seq.drafted -= n
