"""1D tensor parallelism (and Megatron sequence parallelism on top) against the formulas and
against PyTorch DTensor, on a small HF LLaMA on 2 gloo ranks (tp=2), in one run:

1. bytes per transformer layer per rank, forward and backward of one step: (a) counted by our
   instrumented collectives (``comm.stats``, "tp" group, read at each block's boundaries; what
   falls outside the blocks, the embedding, LM head and loss, is shown apart), (b) what the OS
   saw each rank write (``/proc/self/io`` ``wchar``) against gloo's wire bytes for those ops,
   (c) against Megatron's per-op formulas (``bench/tensor_parallel/formulas.py``);
2. step time of ours against DTensor ``parallelize_module`` (Colwise q/k/v/gate/up, Rowwise
   o/down; then also ``SequenceParallel`` norms), rounds interleaved in a rotating order, median
   and min-max over rounds, and each variant's first-step loss (same weights, same batch);
3. bytes saved for backward per layer per rank (``SavedActivations``) against Korthikanti et
   al. 2022's formulas adapted to LLaMA.

The formulas and their derivation: docs/parallel/tensor.md, "Tensor-parallel communication and
activation formulas". ``--quick``: a smaller model and fewer rounds.
"""

from __future__ import annotations

import argparse
import statistics

from bench.common.layer_meter import layer_delta
from bench.common.table import print_table
from bench.tensor_parallel.formulas import (
    PASSES,
    Shape,
    layer_activation_bytes,
    layer_activation_terms,
    layer_collectives,
    outside_collectives,
    total,
    wire_total,
)

FULL = dict(batch=4, seq=128, hidden=256, heads=8, kv_heads=4, ffn=768, layers=4, vocab=512)
QUICK = dict(batch=2, seq=64, hidden=128, heads=4, kv_heads=2, ffn=384, layers=2, vocab=256)
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
KIB = 1024
NOT_RUN = "not run (below)"


def quick_shape(tp: int = 2) -> Shape:
    return Shape(**QUICK, tp=tp)


def _run(rank: int, world: int, shape: Shape, rounds: int, steps: int) -> dict:
    from bench.tensor_parallel.ranks import count, timed

    return {"count": count(rank, world, shape), "timed": timed(rank, world, shape, rounds, steps)}


# ---- per layer, from the per-block readings --------------------------------------------------
def outside_delta(result: dict, pass_: str) -> dict:
    """The pass's readings minus layers x one layer: embedding, head, loss, and SP's entry and
    exit."""
    whole, layer, n = result["passes"][pass_], layer_delta(result["blocks"], pass_), \
        len(result["blocks"])
    ops = {}
    for op, (calls, nbytes) in whole["ops"].items():
        c, b = layer["ops"].get(op, (0, 0))
        if calls - n * c:
            ops[op] = (calls - n * c, nbytes - n * b)
    return {"ops": ops, "wchar": whole["wchar"] - n * layer["wchar"]}


def as_ops(counted: dict) -> list[tuple[str, int, float]]:
    """{op: (calls, bytes)} -> [(op, calls, mean bytes per call)], the formulas' form."""
    return [(op, calls, nbytes / calls) for op, (calls, nbytes) in sorted(counted.items())]


def ops_label(ops: list) -> str:
    """"2 AG + 2 RS": calls per op, an op listed twice (of two sizes) summed."""
    calls: dict[str, int] = {}
    for op, n, _ in ops:
        calls[op] = calls.get(op, 0) + n
    return " + ".join(f"{n} {SHORT.get(op, op)}" for op, n in calls.items()) or "none"


def activation_per_layer(result: dict, shape: Shape) -> int:
    """Bytes one layer saves: a block after the first (the first also holds the RoPE tables
    every layer shares), or the only one."""
    saved = result["saved"]
    return min(saved[1:]) if len(saved) > 1 else saved[0]


# ---- the report -------------------------------------------------------------------------------
def _comm_rows(counted: dict, shape: Shape, where: str) -> tuple[list, list]:
    stats_rows, wire_rows = [], []
    for name, result in counted.items():
        sp = name.endswith("+SP")
        if isinstance(result, str):
            stats_rows.append((name, "-", NOT_RUN, "", "", "", ""))
            wire_rows.append((name, "-", NOT_RUN, "", "", "", ""))
            continue
        formulas = (layer_collectives if where == "layer" else outside_collectives)(shape, sp)
        for pass_ in PASSES:
            d = (layer_delta(result["blocks"], pass_) if where == "layer"
                 else outside_delta(result, pass_))
            want = formulas[pass_]
            wire_want = wire_total(want, shape.tp)
            if result["passes"][pass_]["ops"] or not name.startswith("DTensor"):
                got = as_ops(d["ops"])
                stats_rows.append((name, pass_, ops_label(got), total(got) / KIB,
                                   ops_label(want), total(want) / KIB,
                                   _ratio(total(got), total(want))))
                wire_got = wire_total(got, shape.tp)
                wire_rows.append((name, pass_, d["wchar"] / KIB, wire_got / KIB,
                                  _ratio(d["wchar"], wire_got), wire_want / KIB,
                                  _ratio(d["wchar"], wire_want)))
            else:  # DTensor: not instrumented
                wire_rows.append((name, pass_, d["wchar"] / KIB, "-", "-", wire_want / KIB,
                                  _ratio(d["wchar"], wire_want)))
    return stats_rows, wire_rows


def _print_not_run(results: dict) -> None:
    for name, why in results.items():
        if isinstance(why, str):
            print(f"  {name} not run: {why}")


def _deterministic(counted: dict) -> dict:
    """What every rank must count alike: the ops and saved bytes. (DTensor's collectives are
    asynchronous: how gloo's socket writes split between neighbouring blocks is timing.)"""
    return {name: r if isinstance(r, str) else
            ([{p: b[p]["ops"] for p in PASSES} for b in r["blocks"]], r["saved"])
            for name, r in counted.items()}


def _ratio(a: float, b: float) -> float | str:
    return a / b if b else ("1.000" if not a else "inf")


def report(per_rank: list[dict], shape: Shape, rounds: int, steps: int) -> None:
    counted = per_rank[0]["count"]
    if any(_deterministic(r["count"]) != _deterministic(counted) for r in per_rank[1:]):
        print("note: the ranks' collective or activation counts differ; rank 0's are shown")
    print(f"{shape.describe()}; {len(per_rank)} gloo ranks, one thread each; KiB = 1024 bytes")
    fwd, bwd, wire = _print_comm(counted, shape)
    act = _print_activations(counted, shape)
    speed = _print_times([r["timed"] for r in per_rank], rounds, steps)
    print(f"\nheadline: ours 1D / DTensor 1D step time = {speed:.2f}x (aim <= 1.0); 1D "
          f"collective bytes per layer / Megatron formula: forward {fwd:.3f}, backward "
          f"{bwd:.3f} (aim 1 +- 5%); wchar per layer within {wire * 100:.1f}% of gloo's wire "
          f"bytes; 1D "
          f"activations / formula {act:.3f} (aim 1 +- 10%)")


def _print_comm(counted: dict, shape: Shape) -> tuple[float, float, float]:
    """Prints 1a and 1b; returns ours 1D's forward and backward ratios to the formula and the
    largest relative gap per layer between wchar and the counted ops' wire bytes."""
    print("\n1a. collective bytes per transformer layer per rank, one step: our comm.stats on "
          "the \"tp\" group (payload handed to each op: an all-gather's input shard, a "
          "reduce-scatter's whole input) against Megatron's per-op formula")
    headers = ("variant", "pass", "counted ops", "KiB", "formula ops", "formula KiB", "ratio")
    layer_stats, layer_wire = _comm_rows(counted, shape, "layer")
    print_table(headers, layer_stats)
    _print_not_run(counted)
    print("\n    outside the layers (vocab-parallel embedding, LM head input, vocab-parallel "
          "cross-entropy; under SP also the sequence split and gather)")
    out_stats, out_wire = _comm_rows(counted, shape, "outside")
    print_table(headers, out_stats)
    print("\n1b. bytes each rank wrote to its sockets per layer (/proc/self/io wchar deltas) "
          "against gloo's wire bytes for the counted ops and for the formula's ops (ring "
          "all-reduce: 2(t-1)/t N; all-gather: (t-1) N_in; reduce-scatter: gloo all-reduces the "
          "whole input, 2(t-1)/t N_in); headers of 48 bytes per message are the rest")
    wire_headers = ("variant", "pass", "wchar KiB", "wire(counted)", "ratio", "wire(formula)",
                    "ratio")
    print_table(wire_headers, layer_wire)
    print("    outside the layers")
    print_table(wire_headers, out_wire)
    fwd, bwd = (r[6] for r in layer_stats[:2])  # ours 1D comes first
    wire = max(abs(r[4] - 1) for r in layer_wire if isinstance(r[4], float))
    return fwd, bwd, wire


def _print_activations(counted: dict, shape: Shape) -> float:
    """Prints 2; returns ours 1D's ratio to the formula."""
    print("\n2. activations saved for backward per layer per rank (SavedActivations, KiB) "
          "against the adapted Korthikanti et al. formula (terms: norms, attention, mlp)")
    rows, ratios = [], {}
    for name, result in counted.items():
        sp = name.endswith("+SP")
        if isinstance(result, str):
            rows.append((name, NOT_RUN, "", "", "", "", ""))
            continue
        got, want = activation_per_layer(result, shape), layer_activation_bytes(shape, sp)
        terms = layer_activation_terms(shape, sp)
        ratios[name] = got / want
        rows.append((name, got / KIB, want / KIB, got / want, terms["norms"] / KIB,
                     terms["attention"] / KIB, terms["mlp"] / KIB))
    print_table(("variant", "measured", "formula", "ratio", "norms", "attention", "mlp"), rows)
    _print_not_run(counted)
    return ratios["ours 1D"]


def _print_times(timed: list[dict], rounds: int, steps: int) -> float:
    """Prints 3; returns ours 1D / DTensor 1D, the median over rounds of the ratio within a
    round."""
    names = list(timed[0]["times"])
    per_round = {n: [max(t["times"][n][i] for t in timed) for i in range(rounds)] for n in names}
    first = timed[0]["first_loss"]
    print(f"\n3. step time: {rounds} rounds x {steps} steps of each variant, order rotating; per "
          "round the slowest rank's median step; median and min-max over rounds; ours/DTensor: "
          "median (min-max) over rounds of the ratio within the round (other load cancels)")
    rows, paired = [], {}
    for n in names:
        ref = "DTensor 1D+SP" if n.endswith("+SP") else "DTensor 1D"
        v, med = per_round[n], statistics.median(per_round[n])
        ratio: object = "-"
        if n.startswith("ours") and ref in per_round:
            paired[n] = [a / b for a, b in zip(v, per_round[ref])]
            ratio = (f"{statistics.median(paired[n]):.3f} ({min(paired[n]):.2f}-"
                     f"{max(paired[n]):.2f})")
        rows.append((n, med * 1e3, min(v) * 1e3, max(v) * 1e3,
                     f"{(max(v) - min(v)) / med * 100:.0f}%", ratio, f"{first[n]:.6f}"))
    for n in timed[0]["skipped"]:
        rows.append((n, NOT_RUN, "", "", "", "", ""))
    print_table(("variant", "median ms", "min", "max", "spread", "ours/DTensor",
                 "first-step loss"), rows)
    _print_not_run(timed[0]["skipped"])
    gap = max(abs(first[n] - first["ours 1D"]) for n in first)
    print(f"first-step losses (same weights, same batch) agree within {gap:.1e}")
    return statistics.median(paired["ours 1D"])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tensor_parallel")
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (quick: 3)")
    parser.add_argument("--steps", type=int, default=None, help="per variant and round; "
                        "default 3 (quick: 2)")
    args = parser.parse_args(argv)
    shape = quick_shape() if args.quick else Shape(**FULL, tp=2)
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (2 if args.quick else 3)

    from kernels_runtime.testing import run_ranks

    per_rank = run_ranks(_run, shape.tp, shape, rounds, steps, timeout_s=1800)
    report(per_rank, shape, rounds, steps)
