"""Calibrate a ``HardwareProfile`` on the ranks that will train: a pool, or fresh local ranks.

The micro-benchmarks live engine-side (``kernels_runtime.calibrate``); this module only sends
them and turns the per-rank records into a profile. ``calibrate(pool)`` goes through the pool's
DirectView like any other engine call, so the notebook never touches torch.distributed.
``calibrate_ranks(world)`` is for scripts, tests and benchmarks without a pool: it spawns local
ranks with ``kernels_runtime.testing.run_ranks`` (imported only when called).
"""

from __future__ import annotations

from typing import Any

from ipyparallel import interactive

from workbench.planner.hardware import HardwareProfile, from_measurements
from workbench.planner.spec import ModelSpec


@interactive
def _measure_on_rank(kwargs: dict[str, Any]) -> dict[str, Any]:
    from kernels_runtime.calibrate import measure

    return measure(**kwargs)


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

    ``model`` (ModelSpec, dict or HF config) makes the matmul benchmark use its shapes.
    """
    kwargs = measure_kwargs(model, dtypes, **extra)
    result = pool.view().apply_async(_measure_on_rank, kwargs)
    records = result.get(timeout=timeout_s)
    return from_measurements(list(records))


def calibrate_ranks(world: int, model: Any = None,
                    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
                    timeout_s: float = 600.0, **extra: Any) -> HardwareProfile:
    """Measure ``world`` fresh local ranks (gloo on CPU, nccl on GPUs) and return the profile."""
    from kernels_runtime.calibrate import calibrate_ranks as run

    return from_measurements(run(world, timeout_s=timeout_s,
                                 **measure_kwargs(model, dtypes, **extra)))
