"""The engine's greedy tokens are HF ``generate``'s, and every step's logits within 1e-4, under
every way of splitting the model, with prefix sharing on and off and with preemption forced.

Models: tiny GPT-2 and LLaMA (grouped-query) trained for 200 steps (``helpers/inference.py``),
fp32. Seven prompts of 5 to 70 tokens, one longer than the 32-token step budget (its prefill runs in
chunks beside the others' decodes), one sharing its first 48 tokens with another (a system
prompt). Each plan runs three engines on the same requests: prefix sharing on (blocks must be
shared), off (none may be), and a KV cache of 8 blocks, too small for the batch (requests must be
preempted and recomputed). The reference is ``generate`` on one prompt at a time.
"""

from __future__ import annotations

import pytest
import torch

from helpers import inference as inf
from helpers.distributed import process_comm

LOGITS_TOL = 1e-4
NEW = 24
LENGTHS = (70, 5, 40, 17, 9, 23)
SHARED = 48


def _prompts() -> list[list[int]]:
    out = inf.prompts(LENGTHS)
    # shares 3 blocks with the first, and lands on the same replica when dp=2 deals them out
    out.append(out[0][:SHARED] + inf.prompts((12,))[0])
    return out


def reference(kind: str, path: str) -> list:
    return inf.references(kind, path, _prompts(), NEW)


def _run(rank: int, world: int, kind: str, path: str, plan: str, small_kv: str,
         spill: str) -> list[dict]:
    from kernels_runtime.inference import Engine, SamplingParams

    variants = {"sharing": {"prefix_sharing": True}, "no sharing": {"prefix_sharing": False},
                "preempted": {"prefix_sharing": True, "kv_mem": small_kv}}
    results = []
    for name, kwargs in variants.items():
        engine = Engine(inf.load(kind, path), plan, comm=process_comm(), max_batch_tokens=32,
                        spill_dir=spill, verbose=False, **kwargs)
        outs = engine.generate(_prompts(), SamplingParams(max_new_tokens=NEW,
                                                          return_logits=True))
        results.append({"variant": name, "stats": engine.stats(),
                        "tokens": [o.token_ids for o in outs],
                        "logits": [torch.stack(o.logits) for o in outs],
                        "errors": [o.error for o in outs]})
    return results


# plan -> (ranks, KV budget small enough to preempt: 8 blocks of this plan's rank)
PLANS = {
    "one rank": ("dp=1", 1, "128KiB"),
    "tp=2": ("tp=2", 2, "64KiB"),
    "pp=2": ("pp=2", 2, "64KiB"),
    "dp=2 replicas": ("dp=2", 2, "128KiB"),
    "weights on host": ("zero=3 offload=static offload_params=1", 1, "128KiB"),
    "weights on disk": ("zero=3 offload=static offload_params=1 host_mem=0", 1, "128KiB"),
}
FAST = {("gpt2", "one rank"), ("llama", "tp=2")}  # make test-fast's share
CASES = [pytest.param(kind, case, id=f"{kind}-{case}",
                      marks=() if (kind, case) in FAST else pytest.mark.slow)
         for kind, case in [("gpt2", p) for p in PLANS]
         + [("llama", p) for p in ("one rank", "tp=2", "pp=2")]]


@pytest.mark.parametrize(("kind", "case"), CASES)
def test_greedy_tokens_and_logits_match_hf_generate(ranks, trained, tmp_path, kind, case):
    plan, n, small_kv = PLANS[case]
    expected = reference(kind, trained[kind])
    results = ranks(n).run(_run, kind, trained[kind], plan, small_kv, str(tmp_path),
                           timeout_s=300)[0]
    for result in results:
        variant, stats = result["variant"], result["stats"]
        assert result["errors"] == [None] * len(expected), result["errors"]
        worst = 0.0
        for i, ((tokens, logits), got_tokens, got_logits) in enumerate(
                zip(expected, result["tokens"], result["logits"])):
            assert got_tokens == tokens, f"{variant}: prompt {i} tokens differ"
            worst = max(worst, (got_logits - torch.stack(logits)).abs().max().item())
        print(f"{kind} {case} {variant}: logits max |diff| {worst:.1e}, prefix hits "
              f"{stats['prefix_hit_blocks']} blocks, preemptions {stats['preemptions']}, "
              f"steps {stats['steps']}")
        assert worst <= LOGITS_TOL, f"{variant}: logits differ by {worst:.1e}"
        if variant == "sharing":
            assert stats["prefix_hit_blocks"] > 0, "the shared system prompt was not shared"
        if variant == "no sharing":
            assert stats["prefix_hit_blocks"] == 0
        if variant == "preempted":
            assert stats["preemptions"] > 0, "the small cache preempted nothing"
        assert stats["blocks_used"] == 0, "finished requests left blocks behind"
        if "offload" in plan:  # the weights really live where the plan put them
            tier = "disk" if "host_mem=0" in plan else "host"
            assert stats["weights"][tier] > 0 and stats["weights"]["device"] == 0, stats

