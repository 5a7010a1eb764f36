"""What the engine does with each request: bad ones get a clear error of their own without
disturbing the rest, aborts give their blocks back, swapped requests continue exactly, seeded
sampling repeats on every run and plan, stop strings and stop tokens end the output where they
appear, a request the cache can never hold is refused at once, and a ``kv_mem`` that holds no
block refuses the engine.

The trained tiny GPT-2 of ``helpers/inference.py`` on real gloo ranks; greedy references are HF
``generate``'s.
"""

from __future__ import annotations

import math

import pytest

from helpers import inference as inf
from helpers.distributed import process_comm

NEW = 16


def _engine(kind: str, path: str, plan: str = "dp=1", **kwargs):
    from kernels_runtime.data.corpus import ByteTokenizer
    from kernels_runtime.inference import Engine

    kwargs.setdefault("tokenizer", ByteTokenizer())
    return Engine(inf.load(kind, path), plan, comm=process_comm(), verbose=False, **kwargs)


def _bad_batch(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import SamplingParams as P

    good = inf.prompts((12, 30, 7))
    cases = [  # (prompt, params) in one generate call: good ones between the bad ones
        (good[0], P(max_new_tokens=NEW)),
        ([], P()),
        ([i % 200 for i in range(inf.CONTEXT + 4)], P()),
        (good[1], P(max_new_tokens=NEW)),
        (good[0], P(max_new_tokens=0)),
        (good[0], P(temperature=-1.0)),
        (good[0], P(temperature=math.nan)),
        (good[0], P(top_p=0.0)),
        (good[0], P(top_p=1.5)),
        (good[0], P(stop=5)),
        (good[0], P(stop=[1, 2])),
        (good[0], P(max_new_tokens=inf.CONTEXT)),
        (good[2], P(max_new_tokens=NEW)),
        ([1, 2, 999], P()),
    ]
    engine = _engine("gpt2", path)
    outs = engine.generate([c[0] for c in cases], [c[1] for c in cases])
    plain = _engine("gpt2", path, tokenizer=None)
    text = plain.generate(["some text"], P())[0]
    alone = engine.generate(good, P(max_new_tokens=NEW))
    return {"outs": [(o.finish_reason, o.error, o.token_ids) for o in outs],
            "alone": [o.token_ids for o in alone], "text": text.error,
            "blocks_used": engine.stats()["blocks_used"]}


def test_bad_requests_get_their_own_error_and_leave_the_batch_alone(ranks, trained):
    out = ranks(1).run(_bad_batch, trained["gpt2"])[0]
    reasons = [o[0] for o in out["outs"]]
    errors = [o[1] for o in out["outs"]]
    good = [0, 3, 12]
    assert [out["outs"][i][2] for i in good] == out["alone"]
    assert all(reasons[i] == "length" and errors[i] is None for i in good), reasons
    expected = {
        1: "the prompt is empty",
        2: f"but the model's context holds {inf.CONTEXT}",
        4: "max_new_tokens must be a positive integer, got 0",
        5: "temperature must be a finite number >= 0",
        6: "temperature must be a finite number >= 0",
        7: "top_p must be in (0, 1], got 0.0",
        8: "top_p must be in (0, 1], got 1.5",
        9: "stop must be a string or a list of strings, got int 5",
        10: "stop must be a string or a list of strings, got list [1, 2]",
        11: "lower max_new_tokens to at most 244",
        13: "prompt token ids must be in [0, 256); got [999]",
    }
    for i, phrase in expected.items():
        assert reasons[i] == "error" and phrase in errors[i], (i, errors[i])
    assert "the engine has no tokenizer" in out["text"], out["text"]
    assert out["blocks_used"] == 0


def _abort(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import SamplingParams

    engine = _engine("gpt2", path)
    prompts = inf.prompts((40, 20, 33))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    for _ in range(4):
        engine.step()
    victim = engine.sequences[ids[1]]
    held, used = len(victim.blocks), engine.pool.num_used
    assert engine.abort(ids[1]) and not engine.abort("no-such-request")
    freed = used - engine.pool.num_used
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return {"held": held, "freed": freed, "reason": outs[ids[1]].finish_reason,
            "others": [outs[i].token_ids for i in (ids[0], ids[2])],
            "used_after": engine.pool.num_used}


def test_abort_frees_the_requests_blocks(ranks, trained):
    out = ranks(1).run(_abort, trained["gpt2"])[0]
    print(f"aborted request held {out['held']} blocks; {out['freed']} freed")
    assert out["held"] >= 2 and out["freed"] == out["held"]
    assert out["reason"] == "abort" and out["used_after"] == 0
    model = inf.load("gpt2", trained["gpt2"])
    prompts = inf.prompts((40, 20, 33))
    assert out["others"] == [inf.reference(model, prompts[i], NEW)[0] for i in (0, 2)]


def _swap(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import SamplingParams

    engine = _engine("llama", path, kv_mem="64KiB", preemption="swap", max_batch_tokens=32)
    outs = engine.generate(inf.prompts((70, 40, 33, 50)), SamplingParams(max_new_tokens=24))
    return {"tokens": [o.token_ids for o in outs], "stats": engine.stats()}


def test_swapped_requests_continue_exactly(ranks, trained):
    out = ranks(1).run(_swap, trained["llama"])[0]
    print(f"preemptions by swap: {out['stats']['preemptions']}")
    assert out["stats"]["preemptions"] > 0
    model = inf.load("llama", trained["llama"])
    assert out["tokens"] == [inf.reference(model, p, 24)[0]
                             for p in inf.prompts((70, 40, 33, 50))]


def _sampled(rank: int, world: int, path: str, plan: str) -> list:
    from kernels_runtime.inference import SamplingParams

    engine = _engine("gpt2", path, plan)
    prompts = inf.prompts((12, 30, 7))
    params = [SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=40, top_p=0.9, seed=s)
              for s in (7, 8, 7)]
    first = engine.generate(prompts, params)
    again = engine.generate(list(reversed(prompts)), list(reversed(params)))
    return [[o.token_ids for o in first], [o.token_ids for o in reversed(again)]]


@pytest.mark.parametrize("plan", ["tp=2", "pp=2"])
def test_seeded_sampling_repeats_on_every_run_and_plan(ranks, trained, plan):
    single = ranks(1).run(_sampled, trained["gpt2"], "dp=1")[0]
    split = ranks(2).run(_sampled, trained["gpt2"], plan)[0]
    assert single[0] == single[1], "a rerun (in another order) sampled other tokens"
    assert split[0] == single[0], f"{plan} sampled other tokens than one rank"
    assert single[0][0] != single[0][1], "seeds 7 and 8 sampled the same tokens"
    assert single[0][0][:NEW] != inf.prompts((12,))[0][:NEW]


def _stops(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import SamplingParams

    engine = _engine("gpt2", path)
    prompt = inf.prompts((30,))[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=40))[0]
    stop = free.text[10:13]
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop=["\x01", stop]))[0]
    token = free.token_ids[5]
    by_id = engine.generate([prompt], SamplingParams(max_new_tokens=40,
                                                     stop_token_ids=[token]))[0]
    return {"free": (free.text, free.token_ids), "stop": stop,
            "cut": (cut.text, cut.finish_reason, cut.stop_reason, cut.token_ids),
            "by_id": (by_id.token_ids, by_id.finish_reason, by_id.stop_reason, by_id.text),
            "token": token}


def test_stop_strings_and_tokens_end_the_output_where_they_appear(ranks, trained):
    out = ranks(1).run(_stops, trained["gpt2"])[0]
    text, tokens = out["free"]
    stop, token = out["stop"], out["token"]
    cut_text, reason, why, cut_tokens = out["cut"]
    assert reason == "stop" and why == stop
    assert cut_text == text[:text.find(stop)], (cut_text, text, stop)
    assert cut_tokens == tokens[:len(cut_tokens)] and len(cut_tokens) < len(tokens)
    ids, reason, why, by_id_text = out["by_id"]
    first = tokens.index(token)
    assert ids == tokens[:first + 1] and reason == "stop" and why == token
    assert by_id_text == text[:len(by_id_text)] and len(by_id_text) == first  # bytes: 1 char each


def _never_fits(rank: int, world: int, path: str) -> str | None:
    from kernels_runtime.inference import SamplingParams

    engine = _engine("gpt2", path, kv_mem="64KiB")  # 4 blocks: 64 tokens
    return engine.generate([inf.prompts((60,))[0]], SamplingParams(max_new_tokens=20))[0].error


def test_a_request_the_cache_can_never_hold_is_refused(ranks, trained):
    error = ranks(1).run(_never_fits, trained["gpt2"])[0]
    assert "5 blocks of 16, but the cache has 4 blocks (kv_mem=64.0 KiB)" in error, error


def _no_block(rank: int, world: int, path: str) -> str:
    try:
        _engine("gpt2", path, kv_mem="8KiB")  # half of one 16-token block
    except ValueError as err:
        return str(err)
    return "built"


def test_a_kv_mem_that_holds_no_block_refuses_the_engine_naming_a_blocks_size(ranks, trained):
    error = ranks(1).run(_no_block, trained["gpt2"])[0]
    assert "kv_mem=8.00 KiB holds no KV block of 16 tokens (16.0 KiB on this rank)" in error, error
