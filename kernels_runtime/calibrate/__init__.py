"""Micro-benchmarks that measure this machine for the planner's cost model, run on real ranks.

A cost model is only as good as its rates: the same code is compute-bound on a GPU and
overhead-bound on two CPU cores, and a bf16 matmul can be ten times slower than an fp32 one on
a CPU without bf16 instructions. So instead of trusting data sheets, ``measure`` times what a
training step is made of, on every rank at once (ranks share the machine as in training):

- matmul FLOP/s per dtype, forward and backward, at a transformer block's product shapes;
- causal attention FLOP/s per dtype (``scaled_dot_product_attention`` forward and backward);
- the memory-bound rest of a block, as bytes kept for backward per second (``compute.py``);
- elementwise bandwidth and the AdamW update rate (the optimizer step);
- bandwidth and latency of all-reduce, reduce-scatter and all-gather, fitted to the ring
  formulas, and how much of a collective hides behind concurrent compute (``comm.py``);
- the runtime's fixed costs per step, micro-batch and layer, per ZeRO stage (``runtime.py``);
- the offload tiers: host<->device copies, the spill disk (page cache bypassed), host memory
  bandwidth (``transfer.py``).

The result is one plain dict per rank; the notebook side (``workbench.planner``, which has no
torch) merges the ranks' records into a ``HardwareProfile``. ``calibrate_ranks`` runs
``measure`` on fresh local ranks; a pool runs it on its engines.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

from kernels_runtime.calibrate import compute
from kernels_runtime.calibrate.comm import RING, collective_fit, overlap_fraction
from kernels_runtime.calibrate.proxy import ProxyBlock
from kernels_runtime.calibrate.runtime import runtime_overheads
from kernels_runtime.comm import Accelerator, Collectives

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure(
    *,
    block: tuple[int, int, int, int, int] | None = None,
    activation: str = "gelu",
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    window_s: float = 0.05,
    reps: int = 5,
    overheads: bool = True,
    transfer: bool = True,
    spill_dir: str | None = None,
) -> dict[str, Any]:
    """Run every micro-benchmark on this rank; collective: every rank of the default group
    calls it. ``block`` = (batch, seq, hidden, heads, ffn) of the transformer block whose
    shapes the compute benchmarks use, and ``activation`` its MLP activation (the model's,
    ideally: the memory-bound rate depends on both)."""
    started = time.perf_counter()
    accelerator = Accelerator.for_backend(dist.get_backend())
    on_device = accelerator.queues_work  # a GPU: calibrate at the sizes it trains at
    device, sync = accelerator.device, accelerator.synchronize
    world = dist.get_world_size()
    comm = Collectives()
    default = (4, 2048, 4096, 32, 16384) if on_device else (4, 128, 256, 4, 1024)
    b, s, h, heads, ffn = block or default
    shapes = ProxyBlock.products(b, s, h, ffn)
    out: dict[str, Any] = {"device": accelerator.name(),
                           "backend": dist.get_backend(), "world": world,
                           "block": [b, s, h, heads, ffn], "activation_fn": activation,
                           "matmul": {}, "attention": {},
                           "activation": {}, "elementwise": {}}
    if on_device:
        out["memory_bytes"] = accelerator.total_memory()
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        out["memory_bytes"] = psutil.virtual_memory().total // max(1, local)
    for name in dtypes:
        if not accelerator.supports(DTYPES[name]):
            continue
        dtype = DTYPES[name]
        comm.barrier()
        out["matmul"][name] = compute.matmul_rates(dtype, shapes, device, sync, window_s)
        out["attention"][name] = compute.attention_rates(dtype, (b, heads, s, h // heads),
                                                         device, sync, window_s)
        out["activation"][name] = compute.activation_rate(dtype, (b, s, h, heads, ffn),
                                                          activation, device, sync, window_s)
        out["elementwise"][name] = compute.elementwise_rate(dtype, b * s * ffn, device, sync,
                                                            window_s)
    out["adam"] = compute.adam_rate(b * s * ffn, device, sync, window_s)
    out["collectives"] = {}
    if world > 1:
        sizes = (1 << 12, 1 << 24, 1 << 28) if on_device else (1 << 12, 1 << 20, 1 << 23)
        for op in RING:
            out["collectives"][op] = collective_fit(op, sizes, comm, None, device, reps)
        out["overlap"] = overlap_fraction(comm, None, device, sizes[-1], sync, reps)
    if transfer:
        from kernels_runtime.calibrate.transfer import transfer_rates

        comm.barrier()
        out["transfer"] = transfer_rates(device, sync, pin=accelerator.pin_memory,
                                         window_s=window_s, spill_dir=spill_dir)
    if overheads:
        out["overhead"] = runtime_overheads((0, 1, 2, 3) if world > 1 else (0,), reps)
    out["seconds"] = time.perf_counter() - started
    return out


def _rank_entry(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    return measure(**kwargs)


def calibrate_ranks(world: int, timeout_s: float = 600.0, **kwargs: Any) -> list[dict[str, Any]]:
    """``measure`` on ``world`` fresh local ranks (``run_ranks``): one record per rank."""
    from kernels_runtime.testing import run_ranks

    return run_ranks(_rank_entry, world, kwargs, timeout_s=timeout_s)
