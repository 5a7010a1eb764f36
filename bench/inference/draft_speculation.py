"""The "draft-model speculation" line of ``python -m bench inference``: the same engine with and
without a draft model, on the prompt-lookup line's workload (``speculation.py``).

Target: SmolLM2-135M-Instruct (30 layers). Draft: the same model cut to its first
``spec_draft_layers`` decoder layers, its final norm and its head (``layer_skip``,
self-speculation by layer skipping; no smaller model shares SmolLM2's tokenizer here, and the
layers are not trained for early exit, so acceptance is what a cut model gives). Greedy, so the
tokens with the draft must be exactly those without it (asserted); tokens/s is generated tokens
over wall seconds on all ranks (``dp=<ranks>``), the acceptance rate accepted over drafted
tokens, and the draft's share of the time is printed (it runs token by token, per sequence).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.common.spread import spread
from bench.inference.speculation import prompts

_ENGINES: dict[str, Any] = {}


def draft_round(rank: int, world: int, folder: str, spec: dict, side: str) -> dict:
    """Every request of the workload, greedy, on the engine holding the draft, with
    ``speculate`` on (``side="on"``) or off (``"off"``: the same engine, no drafting): wall
    seconds, generated tokens, the tokens, drafts drafted and
    accepted and seconds spent drafting (summed over replicas)."""
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.draft import layer_skip

    torch.set_num_threads(1)
    if "engine" not in _ENGINES:  # one engine per rank process, reused by every round
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        draft = layer_skip(model, spec["spec_draft_layers"])
        _ENGINES["engine"] = Engine(model, f"dp={world}", kv_mem="64MiB", prefix_sharing=False,
                                max_num_seqs=spec["spec_requests"], draft_model=draft,
                                verbose=False)
    engine = _ENGINES["engine"]
    requests = prompts(folder, spec["spec_requests"])
    params = SamplingParams(max_new_tokens=spec["spec_tokens"],
                            speculate=spec["spec_draft"] if side == "on" else 0)
    before = engine.stats()
    drafting = engine.speculation.seconds
    dist.barrier()
    start = time.perf_counter()
    outs = engine.generate(requests, params)
    dist.barrier()
    seconds = time.perf_counter() - start
    after = engine.stats()
    counts = torch.tensor([after[k] - before[k] for k in ("spec_drafted_tokens",
                                                          "spec_accepted_tokens")]
                          + [engine.speculation.seconds - drafting],
                          dtype=torch.float64)
    dist.all_reduce(counts)
    return {"seconds": seconds, "tokens": [o.token_ids for o in outs],
            "generated": sum(len(o.token_ids) for o in outs), "drafted": int(counts[0]),
            "accepted": int(counts[1]), "draft_seconds": float(counts[2]) / world}


def run(pool: Any, spec: dict, rounds: int, folder: str | None = None) -> dict:
    """Rounds alternating which side goes first; ``{"skipped": why}`` without the model."""
    from workbench.models.smollm2 import smollm2_instruct

    try:
        folder = folder or str(smollm2_instruct())
    except Exception as err:  # noqa: BLE001 - no model: the line says why, the rest runs
        return {"skipped": f"{type(err).__name__}: {err}"}
    out: dict[str, list] = {"on": [], "off": []}
    for r in range(rounds):
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            out[side].append(pool.run(draft_round, folder, spec, side, timeout_s=1800)[0])
    pool.run(release)
    return out


def release(rank: int, world: int) -> None:
    """Drop this rank's engine (its weights, KV cache and draft)."""
    import gc

    _ENGINES.clear()
    gc.collect()


def report(out: dict, spec: dict) -> dict:
    """Print the line; the speedup (median of the rounds' ratios) and acceptance rate."""
    if "skipped" in out:
        print(f"draft-model speculation: skipped, SmolLM2-135M-Instruct unavailable "
              f"({out['skipped']})")
        return {}
    on, off = out["on"], out["off"]
    for a in on + off:
        if a["tokens"] != off[0]["tokens"]:
            raise AssertionError("draft-model speculation changed the greedy tokens: a bug in "
                                 "kernels_runtime/inference/draft.py")
    rate = {side: [r["generated"] / r["seconds"] for r in out[side]] for side in ("on", "off")}
    ratio = [a / b for a, b in zip(rate["on"], rate["off"])]
    drafted = sum(r["drafted"] for r in on)
    accepted = sum(r["accepted"] for r in on) / drafted if drafted else 0.0
    share = statistics.median(r["draft_seconds"] / r["seconds"] for r in on)
    print(f"draft-model speculation (target SmolLM2-135M-Instruct, 30 layers; draft: its first "
          f"{spec['spec_draft_layers']} layers + final norm + head, layer skip; same workload, "
          f"up to {spec['spec_draft']} drafts a step): {spread(rate['on'], 1)} tokens/s with, "
          f"{spread(rate['off'], 1)} without: {statistics.median(ratio):.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f}); greedy tokens identical; acceptance "
          f"{accepted:.0%}; drafting {share:.0%} of the time with")
    return {"draft_speculation": statistics.median(ratio), "draft_acceptance": accepted}
