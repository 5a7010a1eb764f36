"""Heterogeneous memory against PyTorch's own, in one run on one rank (HF GPT-2, small config).

- auto placement when everything fits: step time of ``zero=2 offload=auto`` with a budget
  that holds the whole model against the same model without offload (aim <= 1.05);
- host Adam: the step of ``offload=static offload_optim=1`` (fp32 masters and AdamW states in
  host memory, stepped chunk by chunk by the user's ``AdamW(fused=True)`` over flat shards)
  against ``torch.optim.AdamW(fused=True)`` over the model's parameters (aim >= 1.0x);
- the disk tier: step time with every kind of state on disk against the bound the disk
  bandwidth alone sets (bytes read from and written to disk per step, each at the sequential
  rate measured with the page cache bypassed, in the same round; aim within 2x), with a
  breakdown of its step beside the same step without offload (``timeline.py``).

Rounds interleave the variants; medians and the spread (min-max) over rounds are printed.
``--rounds`` sets their number; ``--skip capacity cgroup`` leaves out the two capacity parts
(most of the run's 25 minutes) while iterating on the step times.
Then capacity (``bench/memory/capacity.py``): the largest model plain PyTorch trains a step of under
``device_mem=256MiB`` against one the host tier trains under the same budget; and physical
capacity (``bench/memory/cgroup.py``): the largest model plain PyTorch trains a step of inside a
768 MiB memory cgroup against one the disk tier trains there.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common.spread import spread
from bench.common.table import print_table
from bench.memory import timeline

VARIANTS = {  # name -> plan (None: plain PyTorch, no parallelize)
    "plain": None,
    "no offload": "dp=1",
    "auto, fits": "dp=1 zero=2 offload=auto device_mem=64GiB",
    "host optimizer": "dp=1 zero=2 offload=static offload_optim=1",
    "disk, everything": "dp=1 zero=2 offload=static offload_params=1 offload_grads=1 "
                        "offload_optim=1 host_mem=0",
}
TIMELINE = ["no offload", "disk, everything"]  # the variants whose step is broken down


def _model(args: argparse.Namespace):
    from kernels_runtime.calibrate.trial import build_model

    return build_model({"model_type": "gpt2", "vocab": 256, "seq": args.seq,
                        "hidden": args.hidden, "layers": args.layers,
                        "heads": max(1, args.hidden // 64), "attention": "sdpa"})


def _build(plan: str | None, args: argparse.Namespace, spill: str):
    import torch

    from kernels_runtime import ParallelContext, parallelize

    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if plan is None:
        return model, opt
    return parallelize(model, opt, ctx=ParallelContext.build(plan), verbose=False,
                       spill_dir=spill)


def _step(model, opt, plain: bool, step: int,
          args: argparse.Namespace) -> tuple[float, float, float, dict[str, float]]:
    """(step seconds, optimizer-step seconds, seconds in the optimizer's arithmetic, the
    step's timeline: ``timeline.py``)."""
    from kernels_runtime import train_step
    from kernels_runtime.calibrate.trial import next_token_loss, token_batch

    batch = token_batch(step, 0, args.batch, args.seq)
    clock = timeline.StepClock(opt, next_token_loss)
    t0 = time.perf_counter()
    if plain:
        clock.loss_fn(model, batch).backward()
        clock.stop()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        return end - t0, end - t1, end - t1, clock.figures()
    seconds = {}
    inner_step = opt.step

    def timed_step() -> bool:
        clock.stop()
        s = time.perf_counter()
        ok = inner_step()
        seconds["opt"] = time.perf_counter() - s
        return ok

    opt.step = timed_step
    arithmetic = getattr(opt.sync, "optimizer_seconds", 0.0)
    try:
        train_step(model, opt, [batch], loss_fn=clock.loss_fn)
    finally:
        opt.step = inner_step
    seconds["adam"] = getattr(opt.sync, "optimizer_seconds", 0.0) - arithmetic
    return time.perf_counter() - t0, seconds["opt"], seconds["adam"], clock.figures()


def _run(rank: int, world: int, args: argparse.Namespace, spill: str) -> dict:
    from pathlib import Path

    from bench.memory import capacity as memory_capacity
    from kernels_runtime.memory.disk import measure_disk_bandwidth

    built = {name: _build(plan, args, spill) for name, plan in VARIANTS.items()}
    times = {name: [] for name in VARIANTS}
    opt_times = {name: [] for name in VARIANTS}
    adam_times = {name: [] for name in VARIANTS}
    timelines = {name: [] for name in TIMELINE}
    moved, disk = [], []
    for r in range(args.rounds + 1):  # round 0 warms up (states created, traces recorded)
        for name, (model, opt) in built.items():
            step, opt_s, adam_s, parts = _step(model, opt, VARIANTS[name] is None, r, args)
            if r:
                times[name].append(step)
                if name in timelines:
                    timelines[name].append(parts)
                opt_times[name].append(opt_s)
                adam_times[name].append(adam_s)
            if r and name == "disk, everything":
                moved.append(dict(opt.sync.last_step["moved"]))
            if r and name == "no offload":  # the disk's rate in every round, beside the steps
                # it bounds, once the disk tier's writes left in flight are long done
                disk.append(measure_disk_bandwidth(Path(spill), 128 * 2**20))
    numel = sum(p.numel() for p in _model(args).parameters())
    del built
    capacity = None if "capacity" in args.skip else memory_capacity.run(args, spill)
    return {"times": times, "opt_times": opt_times, "adam_times": adam_times, "moved": moved,
            "timelines": timelines,
            "numel": numel, "disk": disk, "capacity": capacity}


def _physical(args: argparse.Namespace, spill: str) -> dict | str:
    from bench.memory import cgroup as memory_cgroup

    return memory_cgroup.run(args, spill)


def report(out: dict) -> dict:
    times, opt_times = out["times"], out["opt_times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    adam = out["adam_times"]
    adam_med = {k: statistics.median(v) for k, v in adam.items()}
    print(f"GPT-2, {out['numel'] / 1e6:.1f}M parameters, one rank, fp32 AdamW(fused=True)")
    print_table(["variant", "step s", "optimizer step s", "of it: Adam arithmetic s"],
                [[k, spread(times[k]), spread(opt_times[k]),
                  spread(adam[k]) if adam[k][0] else "-"] for k in times])
    print("(medians over rounds, min-max in brackets)")
    # per round: the bytes the disk tier read and wrote in its step, each at the rate measured
    # for it in that round (reads and writes in sequence: no overlap between them assumed)
    reads = [sum(v for (a, _), v in m.items() if a == "disk") for m in out["moved"]]
    writes = [sum(v for (_, b), v in m.items() if b == "disk") for m in out["moved"]]
    bounds = [r / read_bps + w / write_bps
              for r, w, (write_bps, read_bps) in zip(reads, writes, out["disk"])]
    per_round = [t / b for t, b in zip(times["disk, everything"], bounds)]
    write_bps = statistics.median(w for w, _ in out["disk"])
    read_bps = statistics.median(r for _, r in out["disk"])
    ratios = {"auto_vs_no_offload": med["auto, fits"] / med["no offload"],
              "host_adam_speed": adam_med["plain"] / adam_med["host optimizer"],
              "host_step_speed": statistics.median(opt_times["plain"])
              / statistics.median(opt_times["host optimizer"]),
              "disk_vs_bound": statistics.median(per_round)}
    print(f"disk: {write_bps / 1e6:.0f} MB/s write, {read_bps / 1e6:.0f} MB/s read (page cache "
          f"bypassed; medians of one measurement per round); "
          f"{statistics.median(reads) / 2**20:.1f} MiB read and "
          f"{statistics.median(writes) / 2**20:.1f} MiB written per step -> bound "
          f"{spread(bounds)} s")
    timeline.report(out["timelines"])
    print("(the disk tier steps a chunk right before its next use, inside the next forward: "
          "its optimizer step s is what is left in step())")
    print(f"auto placement when everything fits / no offload: {ratios['auto_vs_no_offload']:.3f}"
          " (aim <= 1.05)")
    print(f"host Adam speed vs torch.optim.AdamW(fused=True): {ratios['host_adam_speed']:.2f}x"
          f" (aim >= 1.0x); the whole host optimizer step (gradients to the host, parameters "
          f"published) {ratios['host_step_speed']:.2f}x")
    print(f"disk-tier step / disk-bandwidth bound: {spread(per_round, 2)} per round (aim <= 2)")
    busy = [(t - f["waited for a CPU s"]) / b for t, f, b in
            zip(times["disk, everything"], out["timelines"]["disk, everything"], bounds)]
    print(f"  the same less the time the compute thread waited for a CPU (other processes' "
          f"load): {spread(busy, 2)}")
    # the same rounds' step without offload: what is the disk tier's own, whatever the load;
    # and that step over the bound, the least the ratio above could be on this machine now
    beside = [d / n for d, n in zip(times["disk, everything"], times["no offload"])]
    floor = [n / b for n, b in zip(times["no offload"], bounds)]
    print(f"  disk-tier step / the same round's step without offload: {spread(beside, 2)}; "
          f"no-offload step / bound (the least the ratio could be): {spread(floor, 2)}")
    from bench.memory import capacity as memory_capacity
    from bench.memory import cgroup as memory_cgroup

    if out["capacity"] is not None:
        ratios["device_budget_capacity"] = memory_capacity.report(out["capacity"])
    if out["physical"] is not None:
        ratios["cgroup_capacity"] = memory_cgroup.report(out["physical"])
    return ratios


QUICK = {"hidden": 64, "layers": 2, "seq": 32, "batch": 2, "rounds": 2}


def main(argv: list[str]) -> dict:
    import tempfile

    from bench.memory import capacity as memory_capacity
    from bench.memory import cgroup as memory_cgroup
    from kernels_runtime.testing import run_ranks

    parser = argparse.ArgumentParser(prog="python -m bench memory")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds")
    parser.add_argument("--skip", nargs="+", default=[], choices=["capacity", "cgroup"],
                        help="leave out the capacity part (device budget) or the cgroup one")
    memory_capacity.add_arguments(parser)
    memory_cgroup.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        for k, v in {**QUICK, **memory_capacity.QUICK, **memory_cgroup.QUICK}.items():
            setattr(args, k, v)
    with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=".") as spill:
        out = run_ranks(_run, 1, args, spill, timeout_s=1800)[0]
        # the cgroup trials are processes of their own
        out["physical"] = None if "cgroup" in args.skip else _physical(args, spill)
    return report(out)
