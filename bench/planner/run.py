"""The plan tuner's cost model against measurements on CPU ranks, and the plan it recommends.

In one run on 2 CPU ranks (gloo), on a small HF GPT-2:
1. calibrate: ``kernels_runtime.calibrate.measure`` on every rank, merged into a
   ``HardwareProfile`` exactly as ``workbench.planner.calibrate(pool)`` does on a pool;
2. ask ``recommend`` for the fastest plan within a memory budget (computed on every rank from
   the same merged records, so all ranks agree) and add it to the plans to measure;
3. train every plan (ZeRO 0-3 x fp32/bf16, micro-batches, activation checkpointing over dp;
   tp and tp + split_gather, Ulysses and ring over all ranks, each with the same global batch
   of ``--batch`` x ranks samples; a plan the runtime refuses is listed with its message):
   each round re-calibrates, then runs ~0.6 s of consecutive steps of every plan in a rotated order,
   so that load from other processes falls on calibration and all plans alike; per plan the
   measurement is the median over rounds of the slowest rank's median step, and the
   predictions use the median calibration;
4. compare predicted and measured step time (median absolute percentage error, aim <= 20%)
   and peak memory (aim <= 10%), and the recommended plan's measured time with the best
   measured plan within the budget (aim: within 10%).

Measured peak memory, defined so a CPU can measure it (there are no allocator counters):
model-state bytes from ``BoostedOptimizer.memory_breakdown()`` at their peak (gradients
reduced, optimizer states built) + bytes autograd saves for backward during one micro-batch's
forward and backward (``kernels_runtime.memory.saved_activations.peak_saved_bytes``, parameters
excluded); with checkpointing, the saved layer inputs and everything outside the blocks plus
the largest block measured without checkpointing (what backward holds while recomputing it).
The model's transient communication buffers are predicted, not measured.

``--project``: per-GPU model-state memory of a GPT-3-175B-like model under DDP and ZeRO-1/2/3
on 64 to 1024 GPUs by the ZeRO paper's formulas; then the cost model's predicted TFLOP/s per
GPU for the rows of Megatron-LM's Table 1 without pipeline parallelism (1.7B-18.4B on 32-256
A100s, tensor parallelism 1-8) and for its pipelined rows that REFERENCES.md quotes (145.6B,
530B, 1T on 1536-3072 A100s, tp=8 with 8-64 stages; heads, batch and schedule assumed, and
said) next to the published ones (``bench/planner/megatron.py``); and
the predicted 2.5D-over-1D and 2.5D-over-2D speedups on 64 GPUs next to Tesseract's 1.38x and
1.53x (``bench/planner/tesseract.py``, which states the setting it assumes).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common.table import print_table
from bench.common.trial import gpt2_model, next_token_loss, token_batch

PLANS = ("zero=0 fp32", "zero=1 fp32", "zero=2 fp32", "zero=3 fp32",
         "zero=0 fp32 mb=2", "zero=2 fp32 mb=2", "zero=0 fp32 ckpt", "zero=3 fp32 ckpt",
         "zero=0 bf16", "zero=1 bf16", "zero=2 bf16", "zero=3 bf16")
# over all ranks ({w}): tensor parallelism, Megatron sequence parallelism, the sp-axis modes
MODEL_PLANS = ("tp={w}", "tp={w} sp_mode=split_gather", "tp={w} bf16", "tp={w} ckpt",
               "sp={w} sp_mode=all_to_all", "sp={w} sp_mode=ring")
MIB = 2**20


def _spec(args: argparse.Namespace):
    """One global batch for every plan: ``--batch`` samples per rank under pure dp."""
    from workbench.planner import ModelSpec

    return ModelSpec(hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 64),
                     vocab=256, seq=args.seq, global_batch=args.batch * args.world,
                     positions=args.seq, model_type="gpt2", attention="sdpa",
                     activation="gelu_new")


def _plans(world: int) -> list[str]:
    return [f"dp={world} {p}" for p in PLANS] + \
        [f"dp=1 {p.format(w=world)}" for p in MODEL_PLANS] if world > 1 else \
        [f"dp=1 {p}" for p in PLANS if "zero=0" in p]


def _run(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from kernels_runtime import ParallelContext, get_policy, parallelize, train_step
    from kernels_runtime.calibrate import measure
    from kernels_runtime.calibrate.trial import measure_memory
    from workbench.planner import predict, recommend
    from workbench.planner.calibration import measure_kwargs
    from workbench.planner.cost_model import plan_label
    from workbench.planner.hardware import from_measurements

    spec = _spec(args)

    def calibrate() -> list:
        record = measure(**measure_kwargs(spec, ("fp32", "bf16"), reps=args.reps))
        records: list = [None] * world
        dist.all_gather_object(records, record)
        return records

    t0 = time.perf_counter()
    rounds = [calibrate()]
    calibration_s = time.perf_counter() - t0
    profile = from_measurements(rounds[0])
    plans = [plan_label(predict(p, spec, profile).plan) for p in _plans(world)]
    peaks = [predict(p, spec, profile).peak_bytes for p in plans]
    budget = args.budget_mib * MIB if args.budget_mib else sorted(peaks)[len(peaks) // 2]
    choice = recommend(spec, world, budget, profile, precisions=("fp32", "bf16"))
    best = plan_label(choice.plan)
    if best not in plans:
        plans.append(best)

    base = ParallelContext.build(f"dp={world}")
    runs, refused = {}, {}
    for plan in plans:
        torch.manual_seed(0)
        model = gpt2_model(args.layers, args.hidden, args.seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        try:  # every rank refuses alike: the appliers' checks run before any collective
            ctx = ParallelContext.build(plan, base.comm)  # groups cached per mesh
            model, bopt = parallelize(model, opt, ctx=ctx)
        except ValueError as err:  # PlanError included
            refused[plan] = str(err).splitlines()[0]
            continue
        runs[plan] = (model, bopt, get_policy(model).blocks(model), ctx)
    plans = [p for p in plans if p in runs]

    def microbatches(step: int, ctx) -> list:
        """This dp rank's samples (tp and sp ranks of one replica see the same batch)."""
        local, m = spec.local_batch(ctx.plan.dp), ctx.plan.microbatches
        x, y = token_batch(step, ctx.dp_rank, local, args.seq)
        size = local // m
        return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(m)]

    memory = {}
    for plan, (model, bopt, blocks, ctx) in runs.items():
        train_step(model, bopt, microbatches(0, ctx), next_token_loss)  # warm-up, states built
        memory[plan] = measure_memory(model, bopt, blocks, microbatches(1, ctx)[0])
    times: dict[str, list[float]] = {plan: [] for plan in plans}
    order = list(runs)
    # consecutive steps per round: about args.round_s seconds of each plan, so that one burst of
    # load from other processes does not decide a round; the same count on every rank
    repeats = {plan: max(1, min(5, round(args.round_s / predict(plan, spec, profile).step_time)))
               for plan in plans}
    for r in range(args.rounds):
        if r:
            rounds.append(calibrate())
        for plan in order[r % len(order):] + order[:r % len(order)]:  # rotate: no plan is
            model, bopt, _, ctx = runs[plan]  # always first or last after a calibration
            steps = []
            for i in range(repeats[plan]):
                t = time.perf_counter()
                train_step(model, bopt, microbatches(2 + r * 8 + i, ctx), next_token_loss)
                steps.append(time.perf_counter() - t)
            times[plan].append(statistics.median(steps))
    return {"rounds": rounds, "times": times, "memory": memory, "budget": budget,
            "recommended": best, "calibration_s": calibration_s, "refused": refused}


def _project(args: argparse.Namespace) -> None:
    from workbench.planner.memory import paper_model_state_bytes

    psi = args.psi
    rows = []
    for n in (64, 128, 256, 512, 1024):
        per_stage = [sum(paper_model_state_bytes(psi, n, stage)) / 1e9 for stage in range(4)]
        rows.append((n, *per_stage, "ZeRO-3" if per_stage[2] > 80 else "ZeRO-2"))
    print(f"model-state memory per GPU (GB = 1e9 bytes), Psi = {psi / 1e9:.0f} B parameters, "
          "mixed precision with Adam (2 + 2 + 12 bytes per parameter, ZeRO paper)")
    print_table(("GPUs", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "fits 80 GB from"), rows)
    check = [round(sum(paper_model_state_bytes(7.5e9, 64, s)) / 1e9, 1) for s in range(4)]
    print(f"\nheadline: {psi / 1e9:.0f}B model states need {rows[-1][4]:.1f} GB per GPU on 1024 "
          f"GPUs with ZeRO-3 vs {rows[-1][1]:.0f} GB with DDP; the paper's 7.5B/64-GPU example "
          f"gives {check} GB (paper: 120, 31.4, 16.6, 1.9)")
    from bench.planner.megatron import print_projection
    from bench.planner.tesseract import print_projection as print_tesseract

    print_projection()
    print_tesseract()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench planner")
    parser.add_argument("--project", action="store_true",
                        help="projections only, no ranks: ZeRO memory table, Megatron-LM "
                             "Table 1 throughput with and without pipelines (predicted vs "
                             "published TFLOP/s per GPU) and "
                             "Tesseract's 2.5D speedups on 64 GPUs")
    parser.add_argument("--psi", type=float, default=175e9, help="parameters, with --project")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=0.6,
                        help="seconds of consecutive steps per plan and round")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per calibration timing")
    parser.add_argument("--budget-mib", type=float, default=0.0,
                        help="memory budget per rank (default: median predicted peak)")
    parser.add_argument("--verbose", action="store_true", help="print each prediction's terms")
    args = parser.parse_args(argv)
    if args.project:
        _project(args)
        return

    from kernels_runtime.testing import run_ranks
    from workbench.planner import predict, recommend
    from workbench.planner.cost_model import plan_label
    from workbench.planner.hardware import combine, from_measurements, median_records

    t0 = time.perf_counter()
    per_rank = run_ranks(_run, args.world, args, timeout_s=3600)
    r0 = per_rank[0]
    profile = from_measurements(median_records([combine(r) for r in r0["rounds"]]))
    spec = _spec(args)
    rows, time_err, mem_err, measured = [], [], [], {}
    for plan in r0["times"]:
        step = statistics.median(max(r["times"][plan][i] for r in per_rank)
                                 for i in range(args.rounds))
        mem = r0["memory"][plan]
        mem_total = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
        p = predict(plan, spec, profile)
        time_err.append(abs(p.step_time / step - 1))
        mem_err.append(abs(p.measurable_bytes / mem_total - 1))
        measured[plan] = (step, mem_total + p.memory_by_category()["buffers"])
        if args.verbose:
            print(p.summary(), {t.name: round(t.seconds * 1e3, 1) for t in p.time})
        rows.append((plan, p.step_time * 1e3, step * 1e3,
                     f"{(p.step_time / step - 1) * 100:+.0f}%", p.exposed_comm_time * 1e3,
                     p.measurable_bytes / MIB, mem_total / MIB,
                     f"{(p.measurable_bytes / mem_total - 1) * 100:+.1f}%"))
    print(f"{spec.describe()}; {args.world} CPU ranks; {profile.name}; {args.rounds} rounds of "
          f"(calibration ~{r0['calibration_s']:.0f} s + ~{args.round_s} s of steps per plan); "
          "medians over rounds; MiB = model states + activations kept for backward")
    fp32, bf16 = profile.matmul_flops["fp32"], profile.matmul_flops["bf16"]
    act = profile.activation_rate
    print(f"calibrated matmul fwd/bwd GFLOP/s: fp32 {fp32 / 1e9:.1f}/"
          f"{profile.backward_flops('fp32') / 1e9:.1f}, bf16 {bf16 / 1e9:.2f}/"
          f"{profile.backward_flops('bf16') / 1e9:.2f}; memory-bound GB kept/s: fp32 "
          f"{act['fp32'] / 1e9:.2f}, bf16 {act['bf16'] / 1e9:.2f}; all-reduce "
          f"{profile.collectives['all_reduce'].bandwidth / 1e9:.2f} GB/s, latency "
          f"{profile.collectives['all_reduce'].latency * 1e6:.0f} us; overlap "
          f"{profile.overlap:.2f}")
    print_table(("plan", "pred ms", "meas ms", "err", "exp comm ms", "pred MiB", "meas MiB",
                 "err"), rows)
    for plan, why in r0["refused"].items():
        print(f"not measured, the runtime refuses {plan}: {why}")
    budget = r0["budget"]
    final = recommend(spec, args.world, budget, profile, precisions=("fp32", "bf16"))
    best_plan = plan_label(final.plan)
    note = "with the median calibration"
    if best_plan not in measured:  # chosen after round 0 and measured: the first calibration's
        best_plan, note = r0["recommended"], "with the first calibration (the median's choice " \
            f"{plan_label(final.plan)} was not measured)"
    fitting = {k: v for k, v in measured.items() if v[1] <= budget}
    best_measured = min(fitting, key=lambda k: fitting[k][0])
    print(f"\nrecommend(budget {budget / MIB:.1f} MiB per rank), {note}:\n{final.explain(3)}")
    if best_plan in measured:
        ratio = measured[best_plan][0] / fitting[best_measured][0]
        print(f"recommended {best_plan}: measured {measured[best_plan][0] * 1e3:.0f} ms; best "
              f"measured within budget {best_measured}: {fitting[best_measured][0] * 1e3:.0f} ms")
    else:
        ratio = float("nan")
        print(f"recommended {best_plan} was not measured: the runtime refuses it "
              f"({r0['refused'].get(best_plan, '?')})")
    mdape_t, mdape_m = statistics.median(time_err) * 100, statistics.median(mem_err) * 100
    print(f"(total bench time {time.perf_counter() - t0:.0f} s)")
    print(f"\nheadline: step-time MdAPE {mdape_t:.1f}% (aim <= 20%), peak-memory MdAPE "
          f"{mdape_m:.1f}% (aim <= 10%) over {len(rows)} plans; recommended plan's measured "
          f"time is {ratio:.2f}x the best measured within budget (aim <= 1.10)")
