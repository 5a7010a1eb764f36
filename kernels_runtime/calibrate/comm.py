"""Communication micro-benchmarks: ring fits of the collectives ZeRO uses, and overlap.

Collectives go through the runtime's own ``Collectives`` (so what is measured is what ZeRO
runs, gloo's reduce-scatter fallback included) and every rank calls each one the same number
of times, in the same order.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kernels_runtime.calibrate.timing import timed
from kernels_runtime.comm import Collectives

RING = {  # op -> (bandwidth factor, latency steps) of a ring over P ranks
    "all_reduce": (lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1)),
    "reduce_scatter": (lambda p: (p - 1) / p, lambda p: p - 1),
    "all_gather": (lambda p: (p - 1) / p, lambda p: p - 1),
}


def collective_fit(op: str, sizes: tuple[int, ...], comm: Collectives, group: Any,
                   device: torch.device, reps: int) -> dict[str, float]:
    """Time ``op`` on fp32 buffers of ``sizes`` bytes (the whole, unsharded buffer) and fit
    t = steps * latency + factor * bytes / bandwidth by least squares (REFERENCES.md's ring
    formula: an all-reduce has factor 2(P-1)/P and 2(P-1) steps, the others half)."""
    world = dist.get_world_size(group)
    times = []
    for nbytes in sizes:
        full = torch.zeros(max(world, nbytes // 4 // world * world), device=device)
        shard = torch.zeros(full.numel() // world, device=device)
        run = {"all_reduce": lambda f=full: comm.all_reduce(f, group=group),
               "reduce_scatter": lambda f=full, s=shard: comm.reduce_scatter(s, f, group=group),
               "all_gather": lambda f=full, s=shard: comm.all_gather(f, s, group=group)}[op]
        comm.barrier(group=group)
        times.append(timed(run, lambda: None, 0.0, reps))
    xs = [float(s) for s in sizes]
    mx, mt = statistics.fmean(xs), statistics.fmean(times)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, times)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    intercept = max(mt - slope * mx, 0.0)
    factor, steps = RING[op]
    return {"bandwidth": factor(world) / slope, "latency": intercept / steps(world)}


def overlap_fraction(comm: Collectives, group: Any, device: torch.device, nbytes: int,
                     sync: Callable[[], None], reps: int) -> float:
    """How much of an all-reduce hides behind concurrent matmuls (1 = fully, 0 = not at all):
    (t_compute + t_comm - t_both) / min(t_compute, t_comm)."""
    buf = torch.zeros(nbytes // 4, device=device)
    a = torch.randn(256, 256, device=device)

    def comm_only() -> None:
        comm.all_reduce(buf, group=group)

    t_comm = timed(comm_only, sync, 0.0, reps)
    t_one = timed(lambda: a @ a, sync, 0.0, reps)
    rounds = torch.tensor([max(1, round(t_comm / max(t_one, 1e-9)))], device=device)
    comm.all_reduce(rounds, op=dist.ReduceOp.MAX, group=group)  # the same loop on every rank

    def compute_only() -> None:
        for _ in range(int(rounds.item())):
            a @ a

    def both() -> None:
        op = comm.all_reduce_async(buf, group=group)
        compute_only()
        op.wait()

    t_compute = timed(compute_only, sync, 0.0, reps)
    t_both = timed(both, sync, 0.0, reps)
    hidden = (t_compute + t_comm - t_both) / max(min(t_compute, t_comm), 1e-9)
    return min(1.0, max(0.0, hidden))
