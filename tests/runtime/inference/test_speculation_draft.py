"""Speculation with a draft model changes how many target forwards compute the tokens, never
which tokens (greedy) or their distribution (sampled), and a draft over another vocabulary is
refused.

Models: a random tiny LLaMA (4 layers, wide initialisation so greedy logits are far from ties)
whose last two layers are damped (their output projections times ``DAMP``), and as its draft
``layer_skip(target, 2)``, its first two layers with its norm and head: a truncated copy that
agrees with the target on most tokens but not all (acceptance ~80% greedy), so both the accept
and the reject paths run. Greedy: every request's tokens are those of the same engine without a
draft, logits within 1e-4. Sampled: seeded requests with the draft against the same seeds
without (two-sample chi-square per position over ``SEEDS`` seeds) and, sharper, every sampled
token against the target's own probability given the tokens before it (teacher-forced):
randomized probability integral transforms ``F(x-) + U p(x)`` are uniform exactly when each
token follows the target's distribution, tested by chi-square over 10 bins.

How we know these catch a broken sampler (checked by hand with ``verify_with_draft`` patched
when this file was written): after a rejection, drawing from ``p`` without the draft (prompt
lookup's residual, wrong for a real ``q``) instead of ``max(0, p - q)`` fails the sampler test
(first token p-value far below ``ALPHA``: 2129 draws of token 0 where 2407 are expected), and so
does accepting every draft; in the engine, accepting every draft fails (no rejection), drawing
from the full ``p`` crashes (a drawn draft counts as accepted and leaves no target token), but
the ``p`` without the draft bug passes the engine's tests (with a draft this close to the
target the error moves too little mass for 128 seeds): the sampler test is the sharp one.
Engine sampled test draft: ``layer_skip(target, 1)``, further from the target (more rejections).

Costs (load average ~10 on the 2-core machine): the sampler 2.5 s; the greedy engine test 3-5 s
once the session's 1-rank pool is up (20 s with its start), the sampled one 4 s (fast tier);
the tp=2 / pp=2 test (``slow``) ~20 s on the 2-rank pool.
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import process_comm

ALPHA = 1e-4  # chi-square tests fail below this p-value (a false alarm 1 run in 10^4)
LOGITS_TOL = 1e-4
DAMP = 0.1
VOCAB = 128
SEEDS = 128
NEW = 8


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of counts ``observed`` against ``expected`` counts (bins with some mass)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was drawn"
    o, e = observed[keep].double(), expected[keep].double()
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0), stat / 2))


def two_sample_p(a: list[int], b: list[int], least: int = 5) -> float:
    """p-value that token lists ``a`` and ``b`` come from one distribution: chi-square
    homogeneity over the tokens seen, those seen fewer than ``least`` times in all pooled
    into one bin (the test's approximation needs counts of about 5)."""
    seen = sorted(set(a) | set(b))
    common = [t for t in seen if a.count(t) + b.count(t) >= least]
    rows = [[s.count(t) for t in common] + [sum(s.count(t) for t in seen if t not in common)]
            for s in (a, b)]
    counts = torch.tensor(rows, dtype=torch.float64)  # (2, bins)
    counts = counts[:, counts.sum(0) > 0]
    if counts.shape[1] < 2:
        return 1.0
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((counts.shape[1] - 1) / 2.0), stat / 2))


# ---- the rejection sampler alone --------------------------------------------------------------
def test_rejection_with_a_draft_distribution_draws_the_target_distribution():
    from kernels_runtime.inference import SamplingParams
    from kernels_runtime.inference.rejection import verify_with_draft
    from kernels_runtime.inference.sampling import probabilities
    from kernels_runtime.inference.sequence import Sequence

    seeds = 4000
    # the target's rows after the last token and after each of 2 drafts, and the draft's q
    # for the 2 drafts: q over-weights token 1 then 3, under-weights the target's favourites
    logits = torch.tensor([[2.0, 0.5, 0.0, -1.0, 1.0], [0.0, 0.3, 1.5, 0.0, -2.0],
                           [0.1, 0.2, 0.3, 0.4, 0.5]])  # (k + 1, V) = (3, 5)
    q = torch.tensor([[0.2, 0.5, 0.1, 0.1, 0.1], [0.1, 0.1, 0.2, 0.5, 0.1]],
                     dtype=torch.float64)  # (k, V)
    params = SamplingParams(temperature=0.9)
    p = torch.stack([probabilities(row, params) for row in logits])  # (3, 5)
    first, second, third, accepted = [], [], [], 0
    drafts = torch.Generator().manual_seed(12345)
    for seed in range(seeds):
        draft = [int(torch.multinomial(q[j], 1, generator=drafts)) for j in range(2)]
        seq = Sequence("r", [1], 1, params, generator=torch.Generator().manual_seed(seed))
        out = verify_with_draft(logits, draft, q, seq)
        a = next(i for i, t in enumerate(out) if i == len(draft) or t != draft[i])
        assert out[a + 1:] == [-1] * (len(draft) - a), out  # nothing drawn past it
        accepted += a
        first.append(out[0])
        if a >= 1:  # the first token was the accepted draft: the second follows row 1
            second.append(out[1])
        if a == 2:
            third.append(out[2])
    for name, tokens, row in (("first", first, p[0]), ("second", second, p[1]),
                              ("bonus", third, p[2])):
        counts = torch.bincount(torch.tensor(tokens), minlength=5)
        got = chi_square_p(counts, len(tokens) * row)
        assert got > ALPHA, f"{name} token: {counts.tolist()} vs {(len(tokens) * row).tolist()}"
    # the acceptance rate is sum_x min(p, q) per row: drafts both accepted and rejected
    expect = torch.minimum(p[0], q[0]).sum()
    assert abs(len(second) / seeds - expect) < 0.05, (len(second) / seeds, float(expect))
    assert 0 < accepted < 2 * seeds


# ---- the engine -------------------------------------------------------------------------------
def target(kind: str = "llama") -> torch.nn.Module:
    """The random tiny LLaMA (or GPT-2) whose last two layers are damped (module
    docstring)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=4, n_head=4,
            initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None))
        damped = [(b.attn.c_proj, b.mlp.c_proj) for b in model.transformer.h[2:]]
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None))
        damped = [(b.self_attn.o_proj, b.mlp.down_proj) for b in model.model.layers[2:]]
    with torch.no_grad():
        for projections in damped:
            for proj in projections:
                proj.weight.mul_(DAMP)
    return model.eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 19, 33, 8, 50)]


def _greedy(rank: int, world: int, plan: str) -> dict:
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.draft import layer_skip

    model = target()
    draft = layer_skip(model, 2)
    kw = dict(comm=process_comm(), verbose=False, max_batch_tokens=64, block_size=4)
    plain = Engine(target(), plan, **kw).generate(
        prompts(), SamplingParams(max_new_tokens=24, return_logits=True))
    engine = Engine(model, plan, draft_model=draft, **kw)
    # speculation per request: on for all but the third
    params = [SamplingParams(max_new_tokens=24, return_logits=True, speculate=s)
              for s in (4, 3, 0, True, 2)]
    outs = engine.generate(prompts(), params)
    stats = dict(engine.stats())
    off = engine.generate(prompts()[2:3], SamplingParams(max_new_tokens=8))  # speculate off
    return {"plain": [o.token_ids for o in plain], "draft": [o.token_ids for o in outs],
            "diff": max((torch.stack(a.logits) - torch.stack(b.logits)).abs().max().item()
                        for a, b in zip(plain, outs)),
            "stats": stats, "off_drafted": engine.stats()["spec_drafted_tokens"]
            - stats["spec_drafted_tokens"], "off": off[0].token_ids,
            "errors": [o.error for o in outs], "held": engine.speculation.held(),
            "blocks_used": engine.stats()["blocks_used"]}


@pytest.mark.slow  # an engine on a rank: make test, not the inner loop
def test_draft_model_greedy_tokens_are_plain_decodings(ranks):
    got = ranks(1).run(_greedy, "dp=1", timeout_s=120)[0]
    assert got["errors"] == [None] * 5
    assert got["draft"] == got["plain"], "greedy tokens changed under a draft model"
    assert got["diff"] <= LOGITS_TOL, f"logits differ by {got['diff']:.1e}"
    assert got["off"] == got["plain"][2][:8]
    s = got["stats"]
    print(f"drafted {s['spec_drafted_tokens']}, accepted {s['spec_accepted_tokens']}, "
          f"steps {s['steps']}")
    assert 0.5 * s["spec_drafted_tokens"] < s["spec_accepted_tokens"] < s["spec_drafted_tokens"]
    assert got["off_drafted"] == 0, "a request with speculate off drafted"
    assert got["held"] == 0 and got["blocks_used"] == 0, "finished requests left state behind"


def _sampled(rank: int, world: int, seeds: int, new: int) -> dict:
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.draft import layer_skip
    from kernels_runtime.inference.sampling import probabilities

    model = target()
    engine = Engine(model, "dp=1", comm=process_comm(), verbose=False, max_num_seqs=seeds,
                    max_batch_tokens=512, draft_model=layer_skip(model, 1))
    prompt = prompts()[1]
    kw = dict(max_new_tokens=new, temperature=0.8, top_k=50)
    spec = engine.generate([prompt] * seeds, [SamplingParams(seed=s, speculate=4, **kw)
                                              for s in range(seeds)])
    stats = engine.stats()
    plain = engine.generate([prompt] * seeds, [SamplingParams(seed=s, **kw)
                                               for s in range(seeds)])
    # randomized PIT of every token under the target's probability given the tokens before
    # it: one teacher-forced forward of every output (all the same length: no eos)
    pits, g = {}, torch.Generator().manual_seed(99)
    params = SamplingParams(**kw)
    with torch.no_grad():
        for side, outs in (("spec", spec), ("plain", plain)):
            ids = torch.tensor([prompt + o.token_ids for o in outs])  # (seeds, P + new)
            logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1]  # (seeds, new, V)
            drawn = ids[:, len(prompt):].flatten().tolist()
            p = torch.stack([probabilities(row, params) for row in logits.flatten(0, 1)])
            below = (p.cumsum(1) - p)[range(len(drawn)), drawn]  # F(x-), (seeds * new,)
            u = torch.rand(len(drawn), dtype=torch.float64, generator=g)
            pits[side] = (below + u * p[range(len(drawn)), drawn]).tolist()
    return {"spec": [o.token_ids for o in spec], "plain": [o.token_ids for o in plain],
            "errors": [o.error for o in spec + plain], "pits": pits,
            "drafted": stats["spec_drafted_tokens"], "accepted": stats["spec_accepted_tokens"]}


@pytest.mark.slow  # an engine on a rank: make test, not the inner loop
def test_sampling_with_a_draft_model_keeps_the_target_distribution(ranks):
    out = ranks(1).run(_sampled, SEEDS, NEW, timeout_s=120)[0]
    assert out["errors"] == [None] * (2 * SEEDS)
    print(f"drafted {out['drafted']}, accepted {out['accepted']}")
    assert 0 < out["accepted"] < out["drafted"], "drafts must be both accepted and rejected"
    spec, plain = out["spec"], out["plain"]
    for j in range(NEW):  # each position: with the draft against without, over the seeds
        p = two_sample_p([t[j] for t in spec], [t[j] for t in plain])
        assert p > ALPHA, f"token {j}: with / without a draft differ (p = {p:.1e})"
    for side, pits in out["pits"].items():  # every token against the target's probabilities
        counts = torch.histc(torch.tensor(pits, dtype=torch.float64), bins=10, min=0, max=1)
        p = chi_square_p(counts, torch.full((10,), len(pits) / 10, dtype=torch.float64))
        assert p > ALPHA, f"{side}: tokens do not follow the target (p = {p:.1e}): {counts}"


def _refused(rank: int, world: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kernels_runtime.inference import Engine

    other = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256))
    try:
        Engine(target(), comm=process_comm(), verbose=False, draft_model=other)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_draft_over_another_vocabulary_is_refused(ranks):
    message = ranks(1).run(_refused, timeout_s=60)[0]
    assert "vocabulary has 132 tokens but the target's has 128" in message, message
    assert "tokenizer" in message


# ---- several ranks ----------------------------------------------------------------------------
def _split(rank: int, world: int) -> dict:
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.draft import layer_skip

    out = {}
    for plan, kind in (("tp=2", "llama"), ("pp=2", "gpt2")):
        model = target(kind)
        engine = Engine(model, plan, comm=process_comm(), verbose=False, max_batch_tokens=64,
                        draft_model=layer_skip(model, 2))
        greedy = engine.generate(prompts(), SamplingParams(max_new_tokens=16, speculate=4))
        sampled = engine.generate(prompts(), [SamplingParams(max_new_tokens=16, speculate=4,
                                                             temperature=0.8, seed=s)
                                              for s in range(len(prompts()))])
        out[plan] = {"greedy": [o.token_ids for o in greedy], "kind": kind,
                     "sampled": [o.token_ids for o in sampled],
                     "accepted": engine.stats()["spec_accepted_tokens"]}
    return out


def _reference(kind: str) -> list[list[int]]:
    """HF ``generate``'s greedy tokens, one prompt at a time."""
    model, ids = target(kind), [torch.tensor([t]) for t in prompts()]
    with torch.no_grad():  # a mask of ones: a prompt's token 0 is not padding
        return [model.generate(i, attention_mask=torch.ones_like(i), max_new_tokens=16,
                               do_sample=False, pad_token_id=0)[0, i.shape[1]:].tolist()
                for i in ids]


@pytest.mark.slow
def test_draft_model_under_tp_and_pp_decides_the_same_on_every_rank(ranks):
    per_rank = ranks(2).run(_split, timeout_s=300)
    for plan, got in per_rank[0].items():
        print(f"{plan} ({got['kind']}): accepted {got['accepted']}")
        assert got["greedy"] == _reference(got["kind"]), f"{plan}: greedy tokens differ from HF"
        assert got["accepted"] > 0, f"{plan}: no draft accepted"
        other = per_rank[1][plan]
        assert other["greedy"] == got["greedy"] and other["sampled"] == got["sampled"], \
            f"{plan}: the ranks decided differently"
        assert other["accepted"] == got["accepted"]
