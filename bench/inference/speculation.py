"""The "prompt-lookup speculation" line of ``python -m bench inference``: the same engine with
and without ``speculate`` on a workload whose answers repeat their prompts.

Speculation pays only where the model copies, which random weights never do, so this line runs
a real model: SmolLM2-135M-Instruct (``workbench.models.smollm2``, converted once into the
model cache), asked in its chat template to repeat, or lightly edit, a passage it is given
(code and prose): what code editing and summaries quoting their input look like. Greedy, so
the tokens with speculation must be exactly those without it (asserted); tokens/s is generated
tokens over wall seconds on all ranks (``dp=<ranks>``, requests dealt round-robin), and the
acceptance rate is accepted over drafted tokens from the engines' stats. Both sides run with
``pack_weights=True`` (``packed_linear.py``): verifying drafts makes steps of 3 to 15 rows, where
the CPU's plain fp32 GEMM takes a slow path (10 rows of the head cost 4x 2 rows' time), and the
packed weights remove that slow path from both sides alike (without them this line measured
1.29x at 64% acceptance). The measuring both speculation lines share is
``speculation_common.py``.
"""

from __future__ import annotations

from typing import Any

from bench.common.spread import spread
from bench.inference.speculation_common import (
    on_off_figures,
    rank_engine,
    release,  # a name of this line's since it had one of its own; run_rounds calls it
    run_rounds,
    timed_generate,
)

__all__ = ["ASKS", "PASSAGES", "prompts", "release", "report", "run", "spec_round"]

PASSAGES = [
    "def moving_average(values, window):\n    total = 0.0\n    out = []\n"
    "    for i, value in enumerate(values):\n        total += value\n"
    "        if i >= window:\n            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n    return out\n",
    "The river rises in the hills north of the town, runs south through the old mill "
    "district, and joins the sea two miles past the harbour. In spring the water is high "
    "and brown; in late summer it is low enough to cross on the stepping stones by the mill.",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
    "    def add(self, key):\n        self.counts[key] = self.counts.get(key, 0) + 1\n\n"
    "    def most_common(self):\n        return max(self.counts, key=self.counts.get)\n",
    "Our meeting is moved from Tuesday to Thursday at ten. Please bring the budget figures "
    "for the third quarter, the draft of the hiring plan, and any questions about the new "
    "office. Lunch will be provided after the meeting in the small conference room.",
]
ASKS = ["Repeat the following text exactly, word for word.",
        "Rewrite the following text, changing nothing but fixing any typos."]


def prompts(folder: str, count: int) -> list[list[int]]:
    """``count`` chat prompts (token ids) asking to repeat or lightly edit a passage."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for i in range(count):
        text = f"{ASKS[i % len(ASKS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return out


def spec_round(rank: int, world: int, folder: str, spec: dict, speculate: int) -> dict:
    """Every request of the workload, greedy, with ``speculate`` drafts a step (0: off): wall
    seconds (the same on every rank), generated tokens, the tokens themselves and the drafts
    drafted and accepted, summed over replicas."""
    from kernels_runtime.inference import Engine, SamplingParams

    engine = rank_engine("prompt-lookup", folder, lambda model: Engine(
        model, f"dp={world}", kv_mem="64MiB", prefix_sharing=False,
        max_num_seqs=spec["spec_requests"], pack_weights=True, verbose=False))
    requests = prompts(folder, spec["spec_requests"])
    params = SamplingParams(max_new_tokens=spec["spec_tokens"], speculate=speculate)
    return timed_generate(engine, requests, params)


def run(pool: Any, spec: dict, rounds: int, folder: str | None = None) -> dict:
    """Rounds alternating which side goes first, on the model in ``folder`` (None: the model
    cache's, converted on first use); ``{"skipped": why}`` when the model is not to be had."""
    return run_rounds(pool, spec_round, lambda side: spec["spec_draft"] if side == "on" else 0,
                      spec, rounds, folder)


def report(out: dict, spec: dict) -> dict:
    """Print the line; the speedup (median of the rounds' ratios) and acceptance rate."""
    if "skipped" in out:
        print(f"prompt-lookup speculation: skipped, SmolLM2-135M-Instruct unavailable "
              f"({out['skipped']})")
        return {}
    fig = on_off_figures(out, "prompt-lookup speculation",
                         "kernels_runtime/inference/speculation.py")
    rate, ratio, on = fig["rate"], fig["ratio"], out["on"]
    per_step = sum(r["accepted"] for r in on) / len(on)
    print(f"prompt-lookup speculation (SmolLM2-135M-Instruct repeating / editing a quoted "
          f"passage, {spec['spec_requests']} requests, {out['off'][0]['generated']} tokens, "
          f"up to {spec['spec_draft']} drafts a step, packed weights on both sides): "
          f"{spread(rate['on'], 1)} tokens/s with, "
          f"{spread(rate['off'], 1)} without: {fig['median']:.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f}) (aim >= 1.5x); greedy tokens identical; "
          f"acceptance {fig['acceptance']:.0%} ({per_step:.0f} drafts accepted per round)")
    return {"speculation": fig["median"], "acceptance": fig["acceptance"]}
