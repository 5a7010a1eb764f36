"""Pipeline inference with micro-batches in flight (``pipelined.py``) gives every request the
tokens the plain pp engine gives it, and really keeps both stages busy at once.

pp=2 on 2 gloo ranks, the tiny trained GPT-2 of ``helpers/inference.py``: prompts of 5 to 70
tokens (one longer than the 32-token step budget, so its prefill runs in chunks), asking for
different numbers of tokens, greedy and seeded sampled, one returning its logits; more requests
arrive while the first run (added between steps), and one is aborted while in flight. Each
engine runs the same calls overlapped and not (``pipeline_overlap=False``); greedy tokens are
also HF ``generate``'s (one prompt at a time), logits within 1e-4. A second overlapped engine
with a cache too small for the batch swaps sequences out and back (its cache operations are
applied on each stage in batch order). The micro-batch scheduler's groups are checked alone,
without ranks.
"""

from __future__ import annotations

import pytest
import torch

from helpers import inference as inf
from helpers.distributed import process_comm

LOGITS_TOL = 1e-4
NEW = 24
LENGTHS = (70, 5, 40, 17, 9, 23, 33, 12)
ASK = (24, 10, 20, 24, 16, 24, 12, 18)  # max_new_tokens of each
SAMPLED = {2: 7, 5: 11}  # prompt index -> seed (the others greedy)
LATE = {3: (4, 5), 7: (6, 7)}  # step -> prompts added before it
ABORT = (9, 1)  # at step 9, abort prompt 1 (in flight under overlap)


def _params(i: int):
    from kernels_runtime.inference import SamplingParams

    if i in SAMPLED:
        return SamplingParams(max_new_tokens=ASK[i], temperature=0.8, top_k=40,
                              seed=SAMPLED[i])
    return SamplingParams(max_new_tokens=ASK[i], return_logits=i == 0)


def _drive(engine) -> dict:
    """The requests, the late ones added between steps, prompt 1 aborted at its step; every
    request's tokens, reason and logits, and the most micro-batches in flight at once."""
    prompts = inf.prompts(LENGTHS)
    early = [i for i in range(len(prompts)) if all(i not in late for late in LATE.values())]
    for i in early:
        engine.add_request(prompts[i], _params(i), request_id=f"r{i}")
    outs, step, most = {}, 0, 0
    while engine.has_unfinished() or step <= max(LATE):
        for i in LATE.get(step, ()):
            engine.add_request(prompts[i], _params(i), request_id=f"r{i}")
        if step == ABORT[0]:
            assert engine.abort(f"r{ABORT[1]}")
        outs.update({o.request_id: o for o in engine.step()})
        if engine.pipelined is not None:
            most = max(most, engine.pipelined.in_flight)
        step += 1
    return {"tokens": {k: o.token_ids for k, o in outs.items()},
            "reasons": {k: o.finish_reason for k, o in outs.items()},
            "logits": torch.stack(outs["r0"].logits), "most_in_flight": most,
            "stats": engine.stats()}


def _run(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import Engine

    def engine(**kwargs):
        return Engine(inf.load("gpt2", path), "pp=2", comm=process_comm(), max_batch_tokens=32,
                      max_num_seqs=8, verbose=False, **kwargs)

    default = engine()
    out = {"default_overlaps": default.pipelined is not None,
           "overlapped": _drive(default),
           "plain": _drive(engine(pipeline_overlap=False)),
           "swapped": _drive(engine(kv_mem="64KiB", preemption="swap"))}
    return out


@pytest.mark.slow
def test_overlapped_pipeline_gives_the_plain_engines_tokens(ranks, trained):
    per_rank = ranks(2).run(_run, trained["gpt2"], timeout_s=300)
    got = per_rank[0]
    assert got["default_overlaps"], "pp=2 did not overlap by default"
    plain = got["plain"]
    assert plain["most_in_flight"] == 0
    model = inf.load("gpt2", trained["gpt2"])
    prompts = inf.prompts(LENGTHS)
    aborted = f"r{ABORT[1]}"
    for name in ("overlapped", "swapped"):
        run = got[name]
        stats = run["stats"]
        print(f"{name}: steps {stats['steps']} (plain {plain['stats']['steps']}), most "
              f"micro-batches in flight {run['most_in_flight']}, preemptions "
              f"{stats['preemptions']}")
        assert run["most_in_flight"] == 2, f"{name}: the stages never ran at the same time"
        assert run["reasons"][aborted] == "abort"
        assert run["reasons"] == plain["reasons"], name
        for key, tokens in plain["tokens"].items():
            if key != aborted:
                assert run["tokens"][key] == tokens, f"{name}: {key} tokens differ"
        worst = (run["logits"] - plain["logits"]).abs().max().item()
        assert worst <= LOGITS_TOL, f"{name}: logits differ by {worst:.1e}"
        assert stats["blocks_used"] == 0, f"{name}: finished requests left blocks behind"
    assert got["swapped"]["stats"]["preemptions"] > 0, "the small cache swapped nothing"
    for i, prompt in enumerate(prompts):  # greedy ones: HF generate's tokens
        if i not in SAMPLED and f"r{i}" != aborted:
            assert plain["tokens"][f"r{i}"] == inf.reference(model, prompt, ASK[i])[0], i
    sampled = [plain["tokens"][f"r{i}"] for i in SAMPLED]
    assert sampled[0] != sampled[1][:len(sampled[0])], "the seeds sampled the same tokens"
    for other in per_rank[1:]:  # the other stage reached the same outputs
        assert other["overlapped"]["tokens"] == got["overlapped"]["tokens"]


# ---- the groups alone ---------------------------------------------------------------------
def test_micro_batch_groups_are_disjoint_and_share_the_queue():
    from kernels_runtime.inference.blocks import BlockPool
    from kernels_runtime.inference.micro_batches import MicroBatchScheduler
    from kernels_runtime.inference.params import SamplingParams
    from kernels_runtime.inference.sequence import FINISHED, Sequence

    sched = MicroBatchScheduler(BlockPool(64, 4, True), max_num_seqs=2, max_batch_tokens=8,
                                preemption="recompute", groups=2)  # each group's limits
    seqs = [Sequence(f"s{i}", list(range(1, 4 + i)), 3 + i, SamplingParams(max_new_tokens=4))
            for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    first, second = sched.schedule(0), sched.schedule(1)
    ran = [[s for s, _ in step.chunks] for step in (first, second)]
    assert ran == [seqs[:2], seqs[2:4]], "groups take the queue in order, 2 seqs each"
    assert first.tokens <= 8 and second.tokens <= 8
    assert sched.running == seqs[:4] and list(sched.waiting) == [seqs[4]]
    assert [s for s, _ in sched.schedule(0).chunks] == seqs[:2], "a group runs only its own"
    sched.finish(seqs[3])
    assert seqs[3].status == FINISHED and seqs[3] not in sched.running
    assert [s for s, _ in sched.schedule(1).chunks][-1] is seqs[4], "group 1 admitted the next"
    with pytest.raises(ValueError, match="groups must be >= 1"):
        MicroBatchScheduler(BlockPool(8, 4, True), 4, 16, "recompute", groups=0)
