"""Inference throughput against HF ``generate``, in one run, on as many ranks as given (2 by
default, one thread each; GPT-2 shape, random weights, fp32):

1. tokens/s of the engine (continuous batching, ``dp=<ranks>`` replicas) against HF ``generate``
   run in as many processes, each on its share of the requests in arrival order, in static
   left-padded batches of the engine's maximum batch size (aim >= 5x; below 3x is a failure
   to explain), and against the same engine with static batches (every row decoding to its
   batch's longest answer, aim >= 1.2x) and with drained batches (finished rows leave, none
   join: what refilling alone wins; on a CPU only a forward's fixed cost, see below);
2. KV utilisation: tokens held / slots of the allocated 16-token blocks, summed over steps
   (aim >= 96%), against contiguous allocation (each running request reserving its prompt plus
   maximum output, or the whole context);
3. blocks saved by prefix sharing on requests that share a long system prompt, and its time
   against the same requests without, over the rounds (``prefix.py``);
4. time to first token and per output token, p50 and p99 over requests (all requests arrive at
   once, so the first includes queueing);
5. prompt-lookup speculation: tokens/s with / without ``speculate`` on SmolLM2-135M-Instruct
   repeating or editing a quoted passage (aim >= 1.5x), greedy tokens identical (asserted),
   and the acceptance rate (``speculation.py``; ``--only speculation`` runs this line alone);
6. pp=2 tokens/s with micro-batches in flight on every stage / the same engine with its stages
   one after another (aim >= 1.3x), tokens identical (asserted; ``pipeline.py``;
   ``--only pipeline`` runs this line alone);
7. draft-model speculation: the workload of 5 with a draft (SmolLM2 cut to its first
   ``spec_draft_layers`` layers: layer skip), tokens/s with / without, the acceptance rate
   and the draft's share of the time (``draft_speculation.py``; ``--only speculation`` runs
   it with 5).

Rounds interleave the three sides (their order rotating); medians with the min-max are printed,
with every side's CPU seconds (all ranks): on a shared machine they vary far less than wall
time. ``--only engine`` runs lines 1-4 alone.
``--quick``: fewer, shorter requests on a smaller model (what the test runs).
"""

from __future__ import annotations

import argparse
import statistics

from bench.common.spread import spread
from bench.common.table import print_table

FULL = dict(requests=96, vocab=8192, context=1024, hidden=256, layers=4, heads=4, batch=16,
            batch_tokens=256, kv_mem="48MiB", prompt_log_mean=5.07, output_log_mean=4.6,
            max_prompt=512, max_output=384, system_prompt=256, seed=0,
            spec_requests=4, spec_tokens=96, spec_draft=4, spec_draft_layers=10)
QUICK = dict(FULL, requests=16, vocab=512, context=256, hidden=64, layers=2, heads=2, batch=4,
             batch_tokens=64, kv_mem="2MiB", prompt_log_mean=3.5, output_log_mean=2.8,
             max_prompt=96, max_output=64, system_prompt=64, spec_requests=2, spec_tokens=24)
SIDES = ("engine", "static engine", "drained engine", "hf")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(spec: dict, ranks: int, rounds: int, only: str = "all",
        smollm2: str | None = None) -> dict:
    from bench.inference import draft_speculation, pipeline, prefix, speculation
    from bench.inference.ranks import run_round
    from kernels_runtime.testing import RankPool

    out: dict = {side: [] for side in SIDES}
    with RankPool(ranks, pg_timeout_s=600) as pool:
        out["pipeline"] = pipeline.run(pool, spec, rounds) if only in ("all", "pipeline") \
            else None
        if only == "pipeline":
            return out
        if only != "engine":  # --only engine: the engine's own lines (1-4) alone
            out["speculation"] = speculation.run(pool, spec, rounds, smollm2)
            out["draft"] = draft_speculation.run(pool, spec, rounds, smollm2)
        if only == "speculation":
            return out
        for r in range(rounds):
            order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
            for side in order:
                out[side].append(pool.run(run_round, spec, side, timeout_s=1800)[0])
        out["prefix"] = prefix.run(pool, spec, rounds)
    return out


def report(out: dict, spec: dict, ranks: int) -> dict:
    from bench.inference import draft_speculation, pipeline, prefix, speculation

    if out["pipeline"] is not None and "speculation" not in out:  # --only pipeline
        return pipeline.report(out["pipeline"], spec)
    if not out["engine"]:  # --only speculation: both lines
        return {**speculation.report(out["speculation"], spec),
                **draft_speculation.report(out["draft"], spec)}
    tokens = out["engine"][0]["tokens"]
    rates = {side: [r["tokens"] / r["seconds"] for r in out[side]] for side in SIDES}
    print(f"{spec['requests']} requests, {tokens} output tokens; GPT-2 h={spec['hidden']}, "
          f"{spec['layers']} layers, vocab {spec['vocab']}; {ranks} ranks; batch "
          f"{spec['batch']} per rank; engine step budget {spec['batch_tokens']} tokens")
    rows = [[side, spread(rates[side], digits=1),
             spread([r["seconds"] for r in out[side]], digits=1)] for side in SIDES]
    print_table(["side", "tokens/s", "seconds", "CPU seconds (all ranks)"],
                [row + [spread([r["cpu"] for r in out[side]], digits=1)]
                 for row, side in zip(rows, SIDES)])
    ratio = [e / h for e, h in zip(rates["engine"], rates["hf"])]
    static = [e / s for e, s in zip(rates["engine"], rates["static engine"])]
    static_cpu = [s["cpu"] / e["cpu"] for e, s in zip(out["engine"], out["static engine"])]
    drained = [e / s for e, s in zip(rates["engine"], rates["drained engine"])]
    drained_cpu = [s["cpu"] / e["cpu"] for e, s in zip(out["engine"], out["drained engine"])]
    kv = out["engine"][-1]["kv"]
    utilisation = kv["tokens"] / kv["slots"]
    print(f"KV utilisation (tokens held / allocated 16-token block slots, over steps): "
          f"{utilisation:.1%} (aim >= 96%); contiguous per request (prompt + max output): "
          f"{kv['tokens'] / kv['reserved']:.1%}; contiguous to the context "
          f"({spec['context']}): {kv['tokens'] / kv['context']:.1%}")
    prefix_figures = prefix.report(out["prefix"], spec)
    timings = out["engine"][-1]["timings"]
    first = [t for t, _ in timings]
    per = [p for _, p in timings if p is not None]
    print(f"time to first token p50 {_percentile(first, 0.5) * 1e3:.0f} ms, p99 "
          f"{_percentile(first, 0.99) * 1e3:.0f} ms; per output token p50 "
          f"{_percentile(per, 0.5) * 1e3:.1f} ms, p99 {_percentile(per, 0.99) * 1e3:.1f} ms")
    print(f"engine / same engine with static batches (rows decode to their batch's longest): "
          f"{statistics.median(static):.2f}x ({min(static):.2f}-{max(static):.2f}) (aim >= "
          f"1.2x); in CPU seconds (less sensitive to the machine's other load): "
          f"{spread(static_cpu, digits=2)}x")
    print(f"engine / same engine with drained batches (finished rows leave, none join): "
          f"{spread(drained, digits=2)}x, in CPU seconds {spread(drained_cpu, digits=2)}x "
          f"(refilling alone saves a forward's fixed cost: on one CPU thread the per-token "
          f"matmuls dominate, so this stays small there; on a GPU the fixed cost dominates)")
    print(f"engine / HF generate (static batches of {spec['batch']}, {ranks} processes): "
          f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) (aim >= 5x)")
    figures = dict(prefix_figures, static_cpu=statistics.median(static_cpu),
                   drained=statistics.median(drained))
    if "speculation" in out:  # not under --only engine
        figures.update(speculation.report(out["speculation"], spec))
        figures.update(draft_speculation.report(out["draft"], spec))
    if out["pipeline"] is not None:
        figures.update(pipeline.report(out["pipeline"], spec))
    return {"ratio": statistics.median(ratio), "static": statistics.median(static),
            "utilisation": utilisation, **figures}


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench inference")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--only", choices=("all", "speculation", "pipeline", "engine"),
                        default="all",
                        help="speculation: only the prompt-lookup speculation line; pipeline: "
                        "only the pp=2 overlapped / plain line; engine: lines 1-4 only")
    parser.add_argument("--smollm2", default=None, metavar="DIR",
                        help="SmolLM2-135M-Instruct's folder for the speculation line "
                        "(default: the model cache's, converted on first use)")
    args = parser.parse_args(argv)
    spec = dict(QUICK if args.quick else FULL)
    if args.requests:
        spec["requests"] = args.requests
    rounds = args.rounds or (1 if args.quick else 3)
    return report(run(spec, args.ranks, rounds, args.only, args.smollm2), spec, args.ranks)
