"""Pipeline schedules against their formulas and against ``torch.distributed.pipelining``, on a
tiny HF GPT-2 (random weights) on 2 gloo ranks (pp=2, one thread each), in one run:

1. bubble of gpipe, 1f1b, interleaved (2 chunks per rank) and zbv: the time each stage waited
   on receives over its step (``last_timeline``), per stage and mean, median over rounds
   with the min-max, against (p-1)/(m+p-1) and interleaved's (p-1)/(V*m+p-1)
   (``simulate.bubble_formula``); zbv should come out below 1f1b;
2. pp=4, which 2 cores cannot run as 4 busy ranks: the per-micro-batch F/B/W times measured
   in 1, fitted per block and stage end (``bench/pipeline/projection.py``), replayed through each
   pp=4 schedule (``simulate.replay``); unit-cost replays beside them equal the formulas;
3. peak activation memory on the first stage (bytes autograd holds saved for backward at
   once): 1F1B against GPipe, expected p/m;
4. step time of our 1f1b and gpipe against torch's ``Schedule1F1B`` and ``ScheduleGPipe`` on
   ``PipelineStage``s of the same blocks on the same split, ours and theirs alternating step
   by step, median and min-max over rounds; the ratio within each round (aim <= 1.05) with
   where the time went (F and B compute, idle); first-step losses.

``--quick``: a smaller model and fewer rounds (what the test runs).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common.spread import spread
from bench.common.table import print_table
from bench.pipeline.projection import (
    BASE,
    CHUNKS,
    Fit,
    fit_costs,
    fit_residual,
    formula,
    projected_replay,
    unit_replay,
)
from bench.pipeline.ranks import OURS, THEIRS, Shape

FULL = dict(hidden=128, layers=8, heads=4, vocab=512, seq=64, rows=4, microbatches=8)
QUICK = dict(hidden=32, layers=8, heads=2, vocab=128, seq=16, rows=2, microbatches=8)
PROJECTED_PP = 4
KIB = 1024


def _mean_per_round(per_rank: list[dict], name: str, key: str) -> list[float]:
    """Per round, the mean over stages of their per-round medians."""
    rounds = zip(*(r["ours"][name][key] for r in per_rank))
    return [sum(values) / len(values) for values in rounds]


def _merged_costs(per_rank: list[dict]) -> dict[str, dict[tuple[str, int], float]]:
    return {name: {k: v for r in per_rank for k, v in r["ours"][name]["costs"].items()}
            for name in OURS}


# ---- 1. measured bubbles ------------------------------------------------------------------
def print_bubbles(per_rank: list[dict], shape: Shape, fit: Fit) -> dict[str, float]:
    """Section 1; returns each schedule's median over rounds of the mean waited/step."""
    p, m = shape.pp, shape.microbatches
    print(f"\n1. bubble at pp={p}, m={m}, measured: per stage, time waited on receives over "
          "its step (last_timeline), median over rounds (min-max); idle = 1 - compute/step "
          "(also counts the end-of-step wait on the loss all-reduce, which is no receive); "
          "replay = the schedule replayed with this run's fitted action costs (section 2)")
    rows, means = [], {}
    for name in OURS:
        stages = [spread(r["ours"][name]["bubble"]) for r in per_rank]
        mean = _mean_per_round(per_rank, name, "bubble")
        means[name] = statistics.median(mean)
        rows.append((name, *stages, spread(mean),
                     statistics.median(_mean_per_round(per_rank, name, "idle")),
                     _dash(formula(name, p, m)),
                     projected_replay(name, fit, shape.layers, p, m).bubble()))
    print_table(("schedule", *(f"stage {r['stage']}" for r in per_rank), "mean", "idle mean",
                 "formula", "replay"), rows)
    _say_zbv(means, f"measured at pp={p}")
    return means


def _say_zbv(bubbles: dict[str, float], where: str) -> None:
    zbv, ref = bubbles["zbv"], bubbles["1f1b"]
    if zbv < ref:
        print(f"zbv below 1f1b {where}: {zbv:.3f} < {ref:.3f}")
    else:
        print(f"NOTE: zbv is NOT below 1f1b {where}: {zbv:.3f} >= {ref:.3f}")


# ---- 2. projected to pp=4 -----------------------------------------------------------------
def print_projection(per_rank: list[dict], shape: Shape, fit: Fit) -> dict[str, float]:
    """Section 2; returns each schedule's replayed pp=4 bubble (mean over ranks)."""
    p, m, q = shape.pp, shape.microbatches, PROJECTED_PP
    costs = _merged_costs(per_rank)
    print(f"\n2. pp={q}, projected: gpipe/1f1b/interleaved's pp={p} action times fitted per "
          "kind as fixed + blocks x per-block + first-stage extra (embeddings) + last-stage "
          "extra (norm, head, loss), ms per micro-batch; zbv's as factors on them (largest "
          "misfit to a measured action: "
          f"{fit_residual(fit, costs, shape.layers, p) * 100:.0f}%)")
    print_table(("action", "fixed", "per block", "first extra", "last extra"),
                [(kind, *(c * 1e3 for c in coef)) for kind, coef in sorted(fit.coef.items())])
    print("   zbv: " + ", ".join(f"{kind} = {factor:.2f} x {BASE[kind]}"
                                  for kind, factor in sorted(fit.zbv.items())))
    print(f"\n   each schedule replayed (simulate.replay) at pp={q} with those costs, {m} "
          f"micro-batches, {shape.layers // (q * CHUNKS['interleaved'])} block(s) per chunk "
          "under interleaved and zbv; unit costs (F=1, B=2) beside the formulas")
    rows, projected = [], {}
    for name in OURS:
        got = projected_replay(name, fit, shape.layers, q, m)
        projected[name] = got.bubble()
        per = [got.bubble(r) for r in range(q)]
        unit = {n: unit_replay(name, n, m).bubble() for n in (p, q)}
        rows.append((name, unit[p], _dash(formula(name, p, m)), unit[q], _dash(formula(name, q, m)),
                     projected[name], f"{min(per):.3f}-{max(per):.3f}"))
    print_table(("schedule", f"unit pp={p}", "formula", f"unit pp={q}", "formula",
                 f"projected pp={q}", "ranks"), rows)
    _say_zbv(projected, f"projected to pp={q}")
    return projected


def _dash(value: float | None) -> Any:
    return "-" if value is None else value


# ---- 3. peak activation memory ------------------------------------------------------------
def print_memory(per_rank: list[dict], shape: Shape) -> float:
    """Section 3; returns our 1F1B / GPipe on the first stage."""
    p, m = shape.pp, shape.microbatches
    first = next(r for r in per_rank if r["stage"] == 0)["peak"]
    print("\n3. peak activation memory on the first stage, one step: bytes autograd held "
          "saved for backward at once (parameters excluded), KiB; expected: the replay's "
          "most chunk activations held on stage 0 over V x m (p/m for 1F1B)")
    rows = []
    for name, bytes_ in first.items():
        ours = THEIRS.get(name, name)
        base = first["torch GPipe" if name in THEIRS else "gpipe"]
        held = unit_replay(ours, p, m).peak_held[0] / (CHUNKS[ours] * m)
        note = "W's kept inputs not seen" if ours == "zbv" else ""
        rows.append((name, bytes_ / KIB, bytes_ / base, held, note))
    print_table(("variant", "KiB", "/ GPipe", "expected", ""), rows)
    ratio = first["1f1b"] / first["gpipe"]
    print(f"1F1B / GPipe on the first stage: {ratio:.3f} (p/m = {p / m:.3f}); torch's: "
          f"{first['torch 1F1B'] / first['torch GPipe']:.3f}")
    return ratio


# ---- 4. step time -------------------------------------------------------------------------
def print_times(per_rank: list[dict], rounds: int, steps: int) -> dict[str, float]:
    """Section 4; returns ours / torch's, median over rounds of the within-round ratio."""
    names = list(per_rank[0]["times"])
    slowest = {n: [max(r["times"][n][i] for r in per_rank) for i in range(rounds)]
               for n in names}
    last = next(r for r in per_rank if r["stage"] == len(per_rank) - 1)
    print(f"\n4. step time: {rounds} rounds x {steps} step(s); each pair (ours and torch's; "
          "then interleaved and zbv) timed alone, a step of each per round, the order flipping "
          "per round; per round the slower rank's median step; ours/torch: median (min-max) "
          "over rounds of the ratio within the round; compute: the slower stage's F and B per "
          "step; idle: 1 - compute / the whole step, mean over stages")
    rows, ratios = [], {}
    for n in names:
        side = "ours" if n in OURS else "theirs"
        summary = [r[side][n] for r in per_rank]
        ratio: Any = "-"
        if n in THEIRS.values():
            theirs = next(t for t, o in THEIRS.items() if o == n)
            paired = [a / b for a, b in zip(slowest[n], slowest[theirs])]
            ratios[n] = statistics.median(paired)
            ratio = f"{ratios[n]:.3f} ({min(paired):.2f}-{max(paired):.2f})"
        v, med = slowest[n], statistics.median(slowest[n])
        idle = _idle(summary)
        rows.append((n if side == "theirs" else f"ours {n}", med * 1e3, min(v) * 1e3,
                     max(v) * 1e3, f"{(max(v) - min(v)) / med * 100:.0f}%", ratio,
                     max(s["compute"] for s in summary) * 1e3, idle,
                     f"{last['first_loss'][n]:.6f}"))
    print_table(("variant", "median ms", "min", "max", "spread", "ours/torch", "compute ms",
                 "idle", "first-step loss"), rows)
    losses = list(last["first_loss"].values())
    print(f"first-step losses (same weights, same micro-batches) agree within "
          f"{max(losses) - min(losses):.1e}")
    for theirs, ours in THEIRS.items():
        best = min(slowest[ours]) / min(slowest[theirs])
        print(_reason(per_rank, ours, theirs, ratios[ours]) + f"; best rounds {best:.3f}")
    return ratios


def _idle(summaries: list[dict]) -> float:
    """Mean over stages of 1 - F and B compute / the whole step (optimizer included)."""
    return statistics.mean(1 - s["compute"] / s["wall"] for s in summaries)


def _reason(per_rank: list[dict], ours: str, theirs: str, ratio: float) -> str:
    """Where the gap is, measured on each side's busiest stage: its F and B compute, and all
    the rest of the step (waits on receives, sends, the tied-embedding sum, the optimizer)."""
    a = max((r["ours"][ours] for r in per_rank), key=lambda s: s["compute"])
    b = max((r["theirs"][theirs] for r in per_rank), key=lambda s: s["compute"])
    compute = (a["compute"] - b["compute"]) * 1e3
    rest = (a["wall"] - a["compute"] - b["wall"] + b["compute"]) * 1e3
    verdict = "within the aim" if ratio <= 1.05 else "ABOVE the aim of 1.05"
    where = "F+B compute" if compute > rest else "the rest of the step"
    return (f"ours {ours} / {theirs} = {ratio:.3f}, {verdict}; ours minus torch's per step on "
            f"the busiest stage: F+B compute {compute:+.1f} ms ({a['compute'] * 1e3:.1f} vs "
            f"{b['compute'] * 1e3:.1f}), the rest {rest:+.1f} ms: most of the gap is {where}")


def report(per_rank: list[dict], shape: Shape, rounds: int, steps: int) -> dict[str, Any]:
    """Prints the four sections and the headline; returns their numbers."""
    print(f"{shape.describe()}; {len(per_rank)} gloo ranks, one thread each")
    fit = fit_costs(_merged_costs(per_rank), shape.layers, shape.pp)
    measured = print_bubbles(per_rank, shape, fit)
    projected = print_projection(per_rank, shape, fit)
    memory = print_memory(per_rank, shape)
    speed = print_times(per_rank, rounds, steps)
    print(f"\nheadline: step time ours/torch 1f1b {speed['1f1b']:.2f}x, gpipe "
          f"{speed['gpipe']:.2f}x (aim <= 1.05); bubble pp={shape.pp} 1f1b "
          f"{measured['1f1b']:.3f} (formula {formula('1f1b', shape.pp, shape.microbatches):.3f}"
          f"), zbv {measured['zbv']:.3f}; pp={PROJECTED_PP} projected 1f1b "
          f"{projected['1f1b']:.3f}, zbv {projected['zbv']:.3f}; first-stage activations "
          f"1F1B/GPipe {memory:.3f} (p/m {shape.pp / shape.microbatches:.3f})")
    return {"measured": measured, "projected": projected, "memory": memory, "speed": speed}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench pipeline")
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 20 (quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="per variant and round; "
                        "default 1, so ours and torch's run close together in time")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="m, a multiple of pp=2 (interleaved's rounds); default 8")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.microbatches:
        sizes["microbatches"] = args.microbatches
    shape = Shape(**sizes)
    rounds = args.rounds or (2 if args.quick else 20)
    steps = args.steps or 1

    from bench.pipeline.ranks import run
    from kernels_runtime.testing import run_ranks

    per_rank = run_ranks(run, shape.pp, shape, rounds, steps, timeout_s=1800)
    report(per_rank, shape, rounds, steps)
