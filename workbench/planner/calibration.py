"""Calibrate a ``HardwareProfile`` on the ranks that will train: a pool, or fresh local ranks.

The micro-benchmarks live engine-side (``kernels_runtime.calibrate``); this module only sends
them and turns the per-rank records into a profile. ``calibrate(pool)`` goes through the pool's
DirectView like any other engine call, so the notebook never touches torch.distributed.
``calibrate_ranks(world)`` is for scripts, tests and benchmarks without a pool: it spawns local
ranks with ``kernels_runtime.testing.run_ranks`` (imported only when called).

Besides ``measure``'s record, every rank times the memory-bound rest of a block at the
micro-batch sizes a plan can train at (``activation_batches``): that rate depends on the
working set on a CPU (``HardwareProfile.activation_rate_at``), so one size cannot price both a
plan of 8 samples per micro-batch and one of 1.
"""

from __future__ import annotations

from typing import Any

from ipyparallel import interactive

from workbench.planner.hardware import HardwareProfile, from_measurements
from workbench.planner.spec import ModelSpec


@interactive
def measure_on_rank(kwargs: dict[str, Any], batches: tuple[int, ...] = ()) -> dict[str, Any]:
    """``kernels_runtime.calibrate.measure(**kwargs)`` on this rank, plus ``activation_curve``:
    per precision and per batch size in ``batches``, the proxy block's bytes kept for backward
    ("kept") and its memory-bound twin's rate ("rate", kept bytes per second), every rank at
    once. Collective (barriers): every rank of the default group calls it."""
    import torch
    import torch.distributed as dist

    from kernels_runtime.calibrate import DTYPES, compute, measure
    from kernels_runtime.calibrate.proxy import ProxyBlock
    from kernels_runtime.comm import Accelerator
    from kernels_runtime.memory.saved_activations import SavedActivations

    record = measure(**kwargs)
    accelerator = Accelerator.for_backend(dist.get_backend())
    device, sync = accelerator.device, accelerator.synchronize
    _, s, h, heads, ffn = record["block"]
    curve: dict[str, dict[str, dict[str, float]]] = {}
    for name in record["activation"]:  # the dtypes this device supports
        dtype = DTYPES[name]
        curve[name] = {}
        for b in batches:
            dist.barrier()
            x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
            with SavedActivations() as saved:  # what one block keeps at this size
                ProxyBlock(h, heads, ffn, record["activation_fn"]).to(device, dtype)(x)
            rate = compute.activation_rate(dtype, (b, s, h, heads, ffn),
                                           record["activation_fn"], device, sync,
                                           kwargs.get("window_s", 0.05))
            curve[name][str(b)] = {"kept": float(saved.total), "rate": rate}
    record["activation_curve"] = curve
    return record


def activation_batches(model: Any) -> tuple[int, ...]:
    """Micro-batch sizes to time the memory-bound work at: 1, 4, 16, ... up to the largest a
    plan can give one rank (the per-rank batch, or the global batch under dp=1), and that one.
    The planner interpolates between them (log-log)."""
    if model is None:
        return ()
    spec = ModelSpec.from_config(model)
    top = spec.batch if spec.batch is not None else (spec.global_batch or 1)
    sizes, b = {top}, 1
    while b < top:
        sizes.add(b)
        b *= 4
    return tuple(sorted(sizes))


def measure_kwargs(model: Any = None, dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
                   **extra: Any) -> dict[str, Any]:
    """Arguments of ``measure``; with a model, its block on the whole per-rank batch, (batch,
    seq, hidden, heads, ffn), and its MLP activation shape the compute benchmarks."""
    kwargs: dict[str, Any] = {"dtypes": tuple(dtypes)}
    if model is not None:
        spec = ModelSpec.from_config(model)
        b = spec.batch if spec.batch is not None else 1
        kwargs["block"] = (b, spec.seq, spec.hidden, spec.heads, spec.ffn_size)
        kwargs["activation"] = spec.activation
    return {**kwargs, **extra}


def calibrate(pool: Any, model: Any = None, dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
              timeout_s: float = 600.0, **extra: Any) -> HardwareProfile:
    """Measure the pool's ranks (all of them, together) and return their profile.

    ``model`` (ModelSpec, dict or HF config) makes the compute benchmarks use its shapes.
    """
    kwargs = measure_kwargs(model, dtypes, **extra)
    result = pool.view().apply_async(measure_on_rank, kwargs, activation_batches(model))
    records = result.get(timeout=timeout_s)
    return from_measurements(list(records))


def _rank_entry(rank: int, world: int, kwargs: dict[str, Any],
                batches: tuple[int, ...]) -> dict[str, Any]:
    return measure_on_rank(kwargs, batches)


def calibrate_ranks(world: int, model: Any = None,
                    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
                    timeout_s: float = 600.0, **extra: Any) -> HardwareProfile:
    """Measure ``world`` fresh local ranks (gloo on CPU, nccl on GPUs) and return the profile."""
    from kernels_runtime.testing import run_ranks

    return from_measurements(run_ranks(_rank_entry, world, measure_kwargs(model, dtypes, **extra),
                                       activation_batches(model), timeout_s=timeout_s))
