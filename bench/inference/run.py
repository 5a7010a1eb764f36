"""Inference throughput against HF ``generate``, in one run, on as many ranks as given (2 by
default, one thread each; GPT-2 shape, random weights, fp32):

1. tokens/s of the engine (continuous batching, ``dp=<ranks>`` replicas) against HF ``generate``
   run in as many processes, each on its share of the requests in arrival order, in static
   left-padded batches of the engine's maximum batch size (aim >= 5x; below 3x is a failure
   to explain), and against the same engine without continuous batching;
2. KV utilisation: tokens held / slots of the allocated 16-token blocks, summed over steps
   (aim >= 96%), against contiguous allocation (each running request reserving its prompt plus
   maximum output, or the whole context);
3. blocks saved by prefix sharing on requests that share a long system prompt;
4. time to first token and per output token, p50 and p99 over requests (all requests arrive at
   once, so the first includes queueing);
5. prompt-lookup speculation: tokens/s with / without ``speculate`` on SmolLM2-135M-Instruct
   repeating or editing a quoted passage (aim >= 1.5x), greedy tokens identical (asserted),
   and the acceptance rate (``speculation.py``; ``--only speculation`` runs this line alone).

Rounds interleave the three sides (their order rotating); medians with the min-max are printed.
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
            spec_requests=4, spec_tokens=96, spec_draft=4)
QUICK = dict(FULL, requests=16, vocab=512, context=256, hidden=64, layers=2, heads=2, batch=4,
             batch_tokens=64, kv_mem="2MiB", prompt_log_mean=3.5, output_log_mean=2.8,
             max_prompt=96, max_output=64, system_prompt=64, spec_requests=2, spec_tokens=24)
SIDES = ("engine", "static engine", "hf")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(spec: dict, ranks: int, rounds: int, only: str = "all",
        smollm2: str | None = None) -> dict:
    from bench.inference import speculation
    from bench.inference.ranks import prefix_round, run_round
    from kernels_runtime.testing import RankPool

    out: dict = {side: [] for side in SIDES}
    with RankPool(ranks, pg_timeout_s=600) as pool:
        out["speculation"] = speculation.run(pool, spec, rounds, smollm2)
        if only == "speculation":
            return out
        for r in range(rounds):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            for side in order:
                out[side].append(pool.run(run_round, spec, side, timeout_s=1800)[0])
        out["prefix"] = {sharing: pool.run(prefix_round, spec, sharing, timeout_s=900)[0]
                         for sharing in (True, False)}
    return out


def report(out: dict, spec: dict, ranks: int) -> dict:
    from bench.inference import speculation

    if not out["engine"]:  # --only speculation
        return speculation.report(out["speculation"], spec)
    tokens = out["engine"][0]["tokens"]
    rates = {side: [r["tokens"] / r["seconds"] for r in out[side]] for side in SIDES}
    print(f"{spec['requests']} requests, {tokens} output tokens; GPT-2 h={spec['hidden']}, "
          f"{spec['layers']} layers, vocab {spec['vocab']}; {ranks} ranks; batch "
          f"{spec['batch']} per rank; engine step budget {spec['batch_tokens']} tokens")
    rows = [[side, spread(rates[side], digits=1),
             spread([r["seconds"] for r in out[side]], digits=1)] for side in SIDES]
    print_table(["side", "tokens/s", "seconds"], rows)
    ratio = [e / h for e, h in zip(rates["engine"], rates["hf"])]
    static = [e / s for e, s in zip(rates["engine"], rates["static engine"])]
    kv = out["engine"][-1]["kv"]
    utilisation = kv["tokens"] / kv["slots"]
    print(f"KV utilisation (tokens held / allocated 16-token block slots, over steps): "
          f"{utilisation:.1%} (aim >= 96%); contiguous per request (prompt + max output): "
          f"{kv['tokens'] / kv['reserved']:.1%}; contiguous to the context "
          f"({spec['context']}): {kv['tokens'] / kv['context']:.1%}")
    on, off = out["prefix"][True], out["prefix"][False]
    print(f"prefix sharing, {spec['requests']} requests after one {spec['system_prompt']}-token "
          f"system prompt: {on['hits']} blocks taken from the index instead of computed "
          f"(prompt tokens computed {on['computed_prompt_tokens']} of {on['prompt_tokens']}); "
          f"peak blocks in use {on['peak_blocks']} vs {off['peak_blocks']} without; "
          f"{on['seconds']:.2f} s vs {off['seconds']:.2f} s")
    timings = out["engine"][-1]["timings"]
    first = [t for t, _ in timings]
    per = [p for _, p in timings if p is not None]
    print(f"time to first token p50 {_percentile(first, 0.5) * 1e3:.0f} ms, p99 "
          f"{_percentile(first, 0.99) * 1e3:.0f} ms; per output token p50 "
          f"{_percentile(per, 0.5) * 1e3:.1f} ms, p99 {_percentile(per, 0.99) * 1e3:.1f} ms")
    print(f"engine / same engine without continuous batching: "
          f"{statistics.median(static):.2f}x ({min(static):.2f}-{max(static):.2f})")
    print(f"engine / HF generate (static batches of {spec['batch']}, {ranks} processes): "
          f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) (aim >= 5x)")
    figures = speculation.report(out["speculation"], spec)
    return {"ratio": statistics.median(ratio), "static": statistics.median(static),
            "utilisation": utilisation, "hits": on["hits"], **figures}


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench inference")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--only", choices=("all", "speculation"), default="all",
                        help="speculation: only the prompt-lookup speculation line")
    parser.add_argument("--smollm2", default=None, metavar="DIR",
                        help="SmolLM2-135M-Instruct's folder for the speculation line "
                        "(default: the model cache's, converted on first use)")
    args = parser.parse_args(argv)
    spec = dict(QUICK if args.quick else FULL)
    if args.requests:
        spec["requests"] = args.requests
    rounds = args.rounds or (1 if args.quick else 3)
    return report(run(spec, args.ranks, rounds, args.only, args.smollm2), spec, args.ranks)
