"""2D (SUMMA) and 2.5D (Tesseract) tensor parallelism against 1D at the same tp and against
their formulas, on a small HF LLaMA (gloo ranks), in one run:

1. bytes per transformer layer per rank, forward and backward of one step: (a) counted by our
   instrumented collectives (``comm.stats`` deltas per group: tp, tp_row, tp_col, tp_dep, read
   at each block's boundaries) against the per-op formulas (``formulas.py``),
   (b) what each rank wrote to its sockets (``/proc/self/io`` wchar) against gloo's wire bytes,
   (c) outside the layers (embedding, final norm, LM head, loss);
2. from the formulas alone, over b*s and h: where a grid sends fewer bytes per rank than 1D at
   the same tp, and the measured points beside the formula's ratios;
3. step time of 2D against 1D at tp=4 (4 ranks), rounds interleaved, median and spread;
4. local parameter bytes and bytes saved for backward per layer per rank (``SavedActivations``)
   against 1/q^2 and 1/(d*q^2) of the unsplit model's, and against the exact formulas.

1D tp=4 and 2D 2x2 run on 4 ranks; 1D tp=8 and 2.5D 2x2x2 on 8 (counting only; if parallelize
refuses a plan its rows say so). The formulas and derivations: docs/parallel/tensor.md, "2D and
2.5D communication and memory". ``--quick``: a smaller model and fewer rounds.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from bench.tensor_parallel_grid.formulas import GridShape, describe_model
from bench.tensor_parallel_grid.report import (
    print_layer_bytes,
    print_memory,
    print_outside,
    print_times,
    print_where_grid_wins,
)

FULL = dict(batch=4, seq=64, hidden=128, heads=8, kv_heads=8, ffn=384, layers=2, vocab=256)
QUICK = dict(batch=4, seq=16, hidden=64, heads=8, kv_heads=8, ffn=192, layers=2, vocab=128)
FOUR, EIGHT = ("1D tp=4", "2D tp=4"), ("1D tp=8", "2.5D tp=8")


def shapes(quick: bool) -> dict[str, GridShape]:
    """Each variant's shape: one model and batch (b divisible by d*q = 4); a 1D variant carries
    the grid of its tp, for its tp and the comparison."""
    two = GridShape(**(QUICK if quick else FULL), side=2)
    deep = replace(two, depth=2)
    return {"1D tp=4": two, "2D tp=4": two, "1D tp=8": deep, "2.5D tp=8": deep}


def _run4(rank: int, world: int, shape: GridShape, rounds: int, steps: int) -> dict:
    from bench.tensor_parallel_grid.ranks import count, timed

    return {"count": count(rank, world, shape, FOUR),
            "timed": timed(rank, world, shape, rounds, steps, FOUR)}


def _run8(rank: int, world: int, shape: GridShape) -> dict:
    from bench.tensor_parallel_grid.ranks import count

    return {"count": count(rank, world, shape, EIGHT)}


def _deterministic(count: dict) -> dict:
    """What every rank must count alike: per-layer ops and saved bytes (outside the layers the
    diagonal ranks swap nothing, so that part differs by design)."""
    return {name: r if isinstance(r, str) else
            ([{p: b[p]["ops"] for p in ("forward", "backward")} for b in r["blocks"]],
             r["saved"], r["params"]) for name, r in count.items()}


def report(four: list[dict], eight: list[dict] | str, shape_of: dict, ref: dict, rounds: int,
           steps: int) -> None:
    groups = [four] + ([eight] if isinstance(eight, list) else [])
    for per_rank in groups:
        if any(_deterministic(r["count"]) != _deterministic(per_rank[0]["count"])
               for r in per_rank[1:]):
            print("note: the ranks' per-layer counts differ; rank 0's are shown")
    counted = {**four[0]["count"], **(eight[0]["count"] if isinstance(eight, list) else
                                      {n: f"8 ranks failed: {eight}" for n in EIGHT})}
    print(f"{describe_model(shape_of['2D tp=4'])}; 1D tp=4 and {shape_of['2D tp=4'].describe()} "
          f"on 4 gloo ranks, 1D tp=8 and {shape_of['2.5D tp=8'].describe()} on 8; one thread "
          "each, 2 cores; KiB = 1024 bytes")
    seen = print_layer_bytes(counted, shape_of)
    print_outside(groups, shape_of)
    print_where_grid_wins(shape_of["2D tp=4"], seen, shape_of)
    speed = print_times([r["timed"] for r in four], rounds, steps)
    memory = print_memory(counted, shape_of, ref)
    exact = [seen[k]["counted"] / seen[k]["formula"] for k in seen]
    gap = max(abs(seen[k]["wchar"] / seen[k]["wire"] - 1) for k in seen)
    grids = [n for n in ("2D tp=4", "2.5D tp=8") if n in memory]
    print(f"\nheadline: 2D / 1D step time at tp=4 = "
          f"{'-' if speed is None else f'{speed:.2f}x'}; per-layer collective bytes / formula "
          f"{min(exact):.3f}-{max(exact):.3f} over {', '.join(dict.fromkeys(k[0] for k in seen))} "
          f"(aim 1 +- 5%); wchar per layer within {gap * 100:.1f}% of gloo's wire bytes; "
          + "; ".join(f"{n} params / ideal {memory[n][0]:.3f}, activations / ideal "
                      f"{memory[n][1]:.3f}" for n in grids) + " (aim 1 +- 10%)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tensor_parallel_grid")
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (quick: 3)")
    parser.add_argument("--steps", type=int, default=None, help="per variant and round; "
                        "default 3 (quick: 2)")
    args = parser.parse_args(argv)
    shape_of = shapes(args.quick)
    rounds = args.rounds or (3 if args.quick else 5)
    steps = args.steps or (2 if args.quick else 3)

    from bench.tensor_parallel_grid.ranks import unsplit
    from kernels_runtime.testing import RanksFailedError, run_ranks

    four = run_ranks(_run4, 4, shape_of["2D tp=4"], rounds, steps, timeout_s=1800)
    try:
        eight: list[dict] | str = run_ranks(_run8, 8, shape_of["2.5D tp=8"], timeout_s=1800)
    except RanksFailedError as err:
        eight = str(err).splitlines()[0]
    report(four, eight, shape_of, unsplit(shape_of["2D tp=4"]), rounds, steps)
