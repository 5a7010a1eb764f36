"""Prompt-lookup speculation changes how many forwards compute the greedy tokens, never which
tokens: with ``speculate`` on, every request gets exactly HF ``generate``'s greedy tokens (and
logits within 1e-4), drafts really are accepted on prompts that repeat themselves, rejected
drafts give back the blocks they took, a seeded sampled request speculating in the batch gets
the tokens its seed gives alone without speculation (rejection sampling draws as plain
decoding does), and no request gets a token past ``max_new_tokens`` or its stop token when a
draft runs over either.

Models: the tiny GPT-2 and LLaMA of ``helpers/inference.py``; one rank, tp=2 (acceptance from
gathered logits, the same on both ranks) and, for GPT-2, pp=2 (the last stage's tokens
broadcast). Each plan runs three engines: a budget of 64 tokens, a budget of 6 (drafts cut to
what the step's chunk reaches) with 4-token blocks (drafts and rollbacks cross block
boundaries every few tokens), and a cache too small for the batch (drafting sequences
preempted). The engine tests take tens of seconds: ``full`` tier.
"""

from __future__ import annotations

import pytest
import torch

from helpers import inference as inf
from helpers.distributed import process_comm

NEW = 32
LOGITS_TOL = 1e-4


# ---- drafting and acceptance, without a model -----------------------------------------------
def test_propose_copies_what_followed_the_latest_match_of_the_longest_suffix():
    from kernels_runtime.inference.speculation import propose

    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    assert propose(tokens, 2) == [3, 4]  # (6, 7) last seen at 6-7: what followed it
    assert propose(tokens, 5) == [3, 4, 6, 7]  # never past the end
    assert propose(tokens + [1, 2], 3) == [9, 6, 7]  # 3-gram (7, 1, 2) beats shorter ones
    assert propose([1, 2, 3], 4) == []  # nothing repeats
    assert propose([8], 4) == []
    assert propose([5, 8, 5, 8], 4) == [5, 8]  # a 2-gram is the shortest cue taken
    assert propose([8, 3, 8], 4) == []  # one repeated token is not
    assert propose([8, 3, 8], 4, min_ngram=1) == [3, 8]


def test_accepted_is_the_longest_agreeing_prefix():
    from kernels_runtime.inference.speculation import accepted

    assert accepted([1, 2, 3], [1, 2, 4, 9]) == 2
    assert accepted([1, 2, 3], [0, 2, 3, 9]) == 0
    assert accepted([1, 2, 3], [1, 2, 3, 9]) == 3


def test_speculate_takes_a_draft_length_with_any_temperature():
    from kernels_runtime.inference import SamplingParams as P

    assert P(temperature=0.7, speculate=True).problem(False) is None  # rejection sampling
    assert "speculate must be" in P(speculate=-1).problem(False)
    assert "speculate must be" in P(speculate="yes").problem(False)
    assert P(speculate=3).problem(False) is None and P(speculate=3).draft_len == 3
    assert P(speculate=True).draft_len == 4 and P().draft_len == 0


# ---- the engine ----------------------------------------------------------------------------
def _prompts() -> list[list[int]]:
    text = inf.prompts((60,))[0]
    quoting = text[:30] + text[:30] + text[:20]  # a summary quoting its input
    edited = text[:45] + [ord("#")] + text[10:40]  # code edited: a line again, changed
    return [quoting, inf.prompts((17,))[0], edited, inf.prompts((41,))[0]]


def _drive(engine, prompts, params) -> tuple[list, list[str]]:
    """Step ``engine`` to the end of ``prompts``; the outputs, and every broken block invariant
    seen after a step (blocks past the computed tokens kept, blocks leaked, drafts left)."""
    ids = [engine.add_request(p, params[i]) for i, p in enumerate(prompts)]
    outs, broken = {}, []
    size = engine.block_size
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        s = engine.scheduler
        held = {b for q in s.running for b in q.blocks}
        # pp: a micro-batch in flight holds its drafts and blocks until it is committed
        flying = engine.pipelined.sequences_in_flight() if engine.pipelined else set()
        for q in s.running:
            if q in flying:
                continue
            if q.drafted or len(q.blocks) != -(-q.computed // size):
                broken.append(f"{q.request_id}: {len(q.blocks)} blocks for {q.computed} "
                              f"tokens, {q.drafted} drafts left")
        if not s.swapped and engine.pool.num_used != len(held):
            broken.append(f"{engine.pool.num_used} blocks used, {len(held)} held")
    return [outs[i] for i in ids], broken


def _run(rank: int, world: int, kind: str, path: str, plan: str, small_kv: str) -> list[dict]:
    from kernels_runtime.inference import Engine, SamplingParams

    prompts = _prompts()
    variants = {"budget 64": {"max_batch_tokens": 64},
                "budget 6, 4-token blocks": {"max_batch_tokens": 6, "block_size": 4},
                "preempted": {"max_batch_tokens": 64, "kv_mem": small_kv}}
    spec = SamplingParams(max_new_tokens=NEW, speculate=True, return_logits=True)
    plain = SamplingParams(max_new_tokens=NEW, return_logits=True)
    seeded = SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=7)
    seeded_spec = SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=7, speculate=True)
    results = []
    for name, kwargs in variants.items():
        # per request: speculation on for the greedy ones but one, and for a sampled request,
        # whose tokens must be those the same seed gives alone without speculation
        params = [spec, spec, plain, spec, seeded_spec]
        engine = Engine(inf.load(kind, path), plan, comm=process_comm(), verbose=False,
                        **kwargs)
        outs, broken = _drive(engine, prompts + [prompts[0]], params)
        alone = Engine(inf.load(kind, path), plan, comm=process_comm(), verbose=False,
                       **kwargs).generate([prompts[0]], seeded)[0]
        results.append({"variant": name, "stats": engine.stats(), "broken": broken,
                        "tokens": [o.token_ids for o in outs[:4]],
                        "logits": [torch.stack(o.logits) for o in outs[:4]],
                        "sampled": (outs[4].token_ids, alone.token_ids),
                        "errors": [o.error for o in outs],
                        "freed": engine.speculation.freed_blocks})
    return results


def reference(kind: str, path: str) -> list:
    return inf.references(kind, path, _prompts(), NEW)


PLANS = {"one rank": ("dp=1", 1, "128KiB"), "tp=2": ("tp=2", 2, "64KiB"),
         "pp=2": ("pp=2", 2, "64KiB")}
CASES = [("gpt2", "one rank"), ("gpt2", "tp=2"), ("gpt2", "pp=2"), ("llama", "one rank"),
         ("llama", "tp=2")]


@pytest.mark.full
@pytest.mark.parametrize(("kind", "case"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_speculative_greedy_tokens_match_hf_generate(ranks, trained, kind, case):
    plan, n, small_kv = PLANS[case]
    expected = reference(kind, trained[kind])
    per_rank = ranks(n).run(_run, kind, trained[kind], plan, small_kv, timeout_s=600)
    for result in per_rank[0]:
        variant, stats = result["variant"], result["stats"]
        assert result["errors"] == [None] * 5, result["errors"]
        assert result["broken"] == [], f"{variant}: {result['broken'][:3]}"
        worst = 0.0
        for i, ((tokens, logits), got, got_logits) in enumerate(
                zip(expected, result["tokens"], result["logits"])):
            assert got == tokens, f"{variant}: prompt {i} tokens differ"
            worst = max(worst, (got_logits - torch.stack(logits)).abs().max().item())
        sampled, alone = result["sampled"]
        print(f"{kind} {case} {variant}: drafted {stats['spec_drafted_tokens']}, accepted "
              f"{stats['spec_accepted_tokens']}, steps {stats['steps']}, freed blocks "
              f"{result['freed']}, preemptions {stats['preemptions']}, logits max |diff| "
              f"{worst:.1e}")
        assert worst <= LOGITS_TOL, f"{variant}: logits differ by {worst:.1e}"
        assert sampled == alone, f"{variant}: a sampled request changed under speculation"
        assert stats["spec_accepted_tokens"] > 0, f"{variant}: no draft was accepted"
        assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
        assert stats["blocks_used"] == 0, f"{variant}: finished requests left blocks behind"
        if variant == "preempted":
            assert stats["preemptions"] > 0, "the small cache preempted nothing"
        if variant.startswith("budget 6"):
            assert result["freed"] > 0, "no rejected draft ever held a block of its own"
    for other in per_rank[1:]:  # every rank decided the same
        assert [r["tokens"] for r in other] == [r["tokens"] for r in per_rank[0]]
        assert [r["stats"]["spec_accepted_tokens"] for r in other] == \
            [r["stats"]["spec_accepted_tokens"] for r in per_rank[0]]


def _limits(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import Engine, SamplingParams

    prompt = _prompts()[2]  # the edited line: its output repeats a 2-gram cue from its start
    engine = Engine(inf.load("gpt2", path), comm=process_comm(), verbose=False)
    lengths = {n: engine.generate([prompt], SamplingParams(max_new_tokens=n, speculate=True))[0]
               for n in (1, 2, 3, 5, 7, 11)}
    full = engine.generate([prompt], SamplingParams(max_new_tokens=NEW))[0].token_ids
    stops = {}
    for j in range(2, NEW):  # a stop token at every position the greedy output reaches
        params = SamplingParams(max_new_tokens=NEW, speculate=True, stop_token_ids=[full[j]])
        stops[j] = engine.generate([prompt], params)[0]
    return {"full": full, "blocks_used": engine.stats()["blocks_used"],
            "lengths": {n: (o.token_ids, o.finish_reason) for n, o in lengths.items()},
            "stops": {j: (o.token_ids, o.finish_reason, o.token_times_s)
                      for j, o in stops.items()}}


@pytest.mark.full
def test_no_token_past_max_new_tokens_or_a_stop_token_inside_a_draft(ranks, trained):
    got = ranks(1).run(_limits, trained["gpt2"], timeout_s=300)[0]
    full = got["full"]
    for n, (tokens, reason) in got["lengths"].items():
        assert tokens == full[:n] and reason == "length", f"max_new_tokens={n}: {tokens}"
    within_step = 0
    for j, (tokens, reason, times) in got["stops"].items():
        first = full.index(full[j])
        assert tokens == full[:first + 1] and reason == "stop", f"stop at {j}: {tokens}"
        within_step += len(times) > 1 and times[-1] == times[-2]  # stopped in a multi-token step
    assert within_step > 0, "no stop token was reached inside a step that made several tokens"
    assert got["blocks_used"] == 0
