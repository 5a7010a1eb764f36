"""Expert parallelism against data parallelism on one small Mixtral, on 2 gloo ranks.

Printed, each against its formula (``formulas.py``) or the other plan measured in the same run:

1. all-to-all bytes per MoE layer, forward and backward, summed over the ep group, from the
   instrumented collectives' counters: rows out and back (2 * tokens * top-k * hidden * bytes)
   plus, in forward, the exchange of row counts;
2. model-state bytes per rank (parameters, gradients, AdamW states, as the optimizer reports
   them) under ``ep=2`` and ``dp=2``: ep keeps 1/ep of the experts;
3. step time of ``ep=2`` and ``dp=2`` on the same model, the two interleaved for ``--rounds``
   rounds (median and spread over rounds; per round, the slower rank's median step);
4. tokens per expert per layer in the first step, as max / mean (1.0: perfectly balanced;
   expert parallelism's step waits for the busiest expert's rank).

On CPU the all-to-all is a memory copy between processes, so the step-time ratio measures this
machine, not a GPU cluster; the byte counts are the same anywhere.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

from bench.common.spread import span
from bench.common.table import print_table
from bench.moe.formulas import Shape, model_state_bytes
from bench.moe.ranks import VARIANTS, counted, timed

WORLD = 2


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench moe")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--quick", action="store_true",
                        help="h=64, 4 experts, seq 32, 3 rounds of 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.ffn, args.experts, args.seq, args.batch = 64, 128, 4, 32, 2
        args.vocab, args.steps = 256, 2
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: the spread needs at least 3 interleaved rounds")
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(batch=args.batch, seq=args.seq, hidden=args.hidden, ffn=args.ffn,
                 experts=args.experts, top_k=args.top_k, layers=args.layers, vocab=args.vocab,
                 ep=WORLD)


def measure(args: argparse.Namespace, pool: Any,
            comm_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Every figure, on ``pool`` (2 ranks); ``comm_factory`` gives each rank's Collectives."""
    shape = shape_of(args)
    per_rank = pool.run(counted, shape, comm_factory, timeout_s=600)
    times = pool.run(timed, shape, args.rounds, args.steps, comm_factory, timeout_s=1200)
    ep = per_rank[0]["ep=2"]
    passes = []
    for name, forward in (("forward", True), ("backward", False)):
        measured = sum(r["ep=2"][name] for r in per_rank)  # over the ep group
        passes.append({"pass": name, "measured": measured / shape.layers,
                       "formula": shape.all_to_all_bytes(forward),
                       "dp=2": sum(r["dp=2"][name] for r in per_rank) / shape.layers})
    params = per_rank[0]["params"]
    state = [{"plan": plan, **r[plan]["state"], "measured": sum(r[plan]["state"].values()),
              "formula": model_state_bytes(params["dense"], params["experts"],
                                           WORLD if plan == "ep=2" else 1), "rank": rank}
             for plan in VARIANTS for rank, r in enumerate(per_rank)]
    rounds = {plan: [max(t["times"][plan][i] for t in times) for i in range(args.rounds)]
              for plan in VARIANTS}  # per round, the slower rank
    return {"shape": shape, "all_to_all": passes, "state": state, "params": params,
            "rounds": rounds, "tokens_at_start": ep["tokens"],
            "imbalance": [_imbalance(layer) for layer in ep["tokens"]]}


def _imbalance(counts: list[int]) -> float:
    """max / mean of one layer's tokens per expert."""
    return max(counts) / statistics.mean(counts)


def report(result: dict[str, Any]) -> None:
    shape = result["shape"]
    print(f"{shape.describe()}; {WORLD} gloo ranks (ep=2: one ep group; dp=2: every expert on "
          "every rank)")
    print("\nall-to-all bytes per MoE layer, summed over the ep group (instrumented collectives)")
    print_table(["pass", "measured", "formula", "equal", "under dp=2"],
                [[p["pass"], f"{p['measured']:.0f}", p["formula"],
                  p["measured"] == p["formula"], f"{p['dp=2']:.0f}"]
                 for p in result["all_to_all"]])
    print(f"formula: 2 x tokens {shape.group_tokens} x top-k {shape.top_k} x hidden "
          f"{shape.hidden} x {shape.elem} B (out and back), + ep x {shape.experts} experts x 8 B "
          "of row counts in forward")
    p = result["params"]
    print(f"\nmodel-state bytes per rank (zero 0, AdamW): {p['dense']} dense and "
          f"{p['experts']} expert parameters; formula 16 B x (dense + experts / ep)")
    print_table(["plan", "rank", "params", "grads", "optimizer", "total", "formula", "equal"],
                [[s["plan"], s["rank"], s["params"], s["grads"], s["optimizer"], s["measured"],
                  s["formula"], s["measured"] == s["formula"]] for s in result["state"]])
    rounds = result["rounds"]
    med = {plan: statistics.median(v) for plan, v in rounds.items()}
    print(f"\nstep time, {len(rounds['ep=2'])} interleaved rounds (the slower rank's median "
          "step per round)")
    print_table(["plan", "median s", "spread s"],
                [[plan, f"{med[plan]:.4f}", span(v, 4)] for plan, v in rounds.items()])
    print("\ntokens per expert (both ranks' slots) in the first step, max / mean per layer: "
          + ", ".join(f"layer {i} {x:.2f} {result['tokens_at_start'][i]}"
                      for i, x in enumerate(result["imbalance"])))
    print(f"headline: ep=2 step {med['ep=2'] / med['dp=2']:.2f}x dp=2's on this machine, "
          f"holding {_state_ratio(result):.2f}x its model state per rank; all-to-all bytes "
          "equal the formula: "
          + str(all(p["measured"] == p["formula"] for p in result["all_to_all"])))


def _state_ratio(result: dict[str, Any]) -> float:
    by_plan = {s["plan"]: s["measured"] for s in result["state"] if s["rank"] == 0}
    return by_plan["ep=2"] / by_plan["dp=2"]


def main(argv: list[str]) -> None:
    from kernels_runtime.testing import RankPool

    args = parse(argv)
    with RankPool(WORLD) as pool:
        result = measure(args, pool)
    report(result)
