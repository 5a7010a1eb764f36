"""The "draft-model speculation" line of ``python -m bench inference``: the same engine with and
without a draft model, on the prompt-lookup line's workload (``speculation.py``).

Target: SmolLM2-135M-Instruct (30 layers). Draft: the same model cut to its first
``spec_draft_layers`` decoder layers, its final norm and its head (``layer_skip``,
self-speculation by layer skipping; no smaller model shares SmolLM2's tokenizer here, and the
layers are not trained for early exit, so acceptance is what a cut model gives). Greedy, so the
tokens with the draft must be exactly those without it (asserted); tokens/s is generated tokens
over wall seconds on all ranks (``dp=<ranks>``), the acceptance rate accepted over drafted
tokens, and the draft's share of the time is printed (it runs token by token, per sequence).
Both sides pack their weights (``pack_weights=True``), as the prompt-lookup line does.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.common.spread import spread
from bench.inference.speculation import prompts
from bench.inference.speculation_common import (
    on_off_figures,
    rank_engine,
    release,  # a name of this line's since it had one of its own; run_rounds calls it
    run_rounds,
    timed_generate,
)

__all__ = ["draft_round", "release", "report", "run"]


def draft_round(rank: int, world: int, folder: str, spec: dict, side: str) -> dict:
    """Every request of the workload, greedy, on the engine holding the draft, with
    ``speculate`` on (``side="on"``) or off (``"off"``: the same engine, no drafting): wall
    seconds, generated tokens, the tokens, drafts drafted and
    accepted and seconds spent drafting (summed over replicas)."""
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.draft import layer_skip

    engine = rank_engine("draft-model", folder, lambda model: Engine(
        model, f"dp={world}", kv_mem="64MiB", prefix_sharing=False,
        max_num_seqs=spec["spec_requests"],
        draft_model=layer_skip(model, spec["spec_draft_layers"]), pack_weights=True,
        verbose=False))
    requests = prompts(folder, spec["spec_requests"])
    params = SamplingParams(max_new_tokens=spec["spec_tokens"],
                            speculate=spec["spec_draft"] if side == "on" else 0)
    return timed_generate(engine, requests, params, draft_seconds=True)


def run(pool: Any, spec: dict, rounds: int, folder: str | None = None) -> dict:
    """Rounds alternating which side goes first; ``{"skipped": why}`` without the model."""
    return run_rounds(pool, draft_round, lambda side: side, spec, rounds, folder)


def report(out: dict, spec: dict) -> dict:
    """Print the line; the speedup (median of the rounds' ratios) and acceptance rate."""
    if "skipped" in out:
        print(f"draft-model speculation: skipped, SmolLM2-135M-Instruct unavailable "
              f"({out['skipped']})")
        return {}
    fig = on_off_figures(out, "draft-model speculation", "kernels_runtime/inference/draft.py")
    rate, ratio = fig["rate"], fig["ratio"]
    share = statistics.median(r["draft_seconds"] / r["seconds"] for r in out["on"])
    print(f"draft-model speculation (target SmolLM2-135M-Instruct, 30 layers; draft: its first "
          f"{spec['spec_draft_layers']} layers + final norm + head, layer skip; same workload, "
          f"up to {spec['spec_draft']} drafts a step): {spread(rate['on'], 1)} tokens/s with, "
          f"{spread(rate['off'], 1)} without: {fig['median']:.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f}); greedy tokens identical; acceptance "
          f"{fig['acceptance']:.0%}; drafting {share:.0%} of the time with")
    return {"draft_speculation": fig["median"], "draft_acceptance": fig["acceptance"]}
