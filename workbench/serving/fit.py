"""Which plan and how many ranks ``workbench serve`` uses for a model folder.

The first command a user types is ``workbench serve --model DIR``, so it must work without a
plan: replicas (dp) over every rank of the pool when the model fits each rank, else tensor
parallelism just wide enough to fit, replicated over the ranks it leaves. A ``--plan`` without
``--pool-size`` gets a pool of the plan's size (dp*tp*pp*sp ranks). Every plan is checked before
any rank works by the runtime's own rules (``Plan.validate`` with the folder's config, and the
engine's ``inference_problem``), so a plan that cannot work is one line saying what is wrong,
never a rank's traceback. Torch-free, like the rest of the notebook side.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from kernels_runtime.byte_sizes import human_bytes
from kernels_runtime.inference.plans import inference_plan, inference_problem
from kernels_runtime.mesh.plan import Plan, PlanError

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
# a replica fits a rank when its weights take at most this share of the rank's memory: the
# rest holds the KV cache (by default half of what is free once the weights are loaded, shared
# by the ranks of a device or host: kernels_runtime/memory/free.py), activations and the runtime
WEIGHT_SHARE = 0.5


def folder_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json``, whose head and layer counts the plan is checked against."""
    config = json.loads((folder / "config.json").read_text())
    return config if isinstance(config, dict) else {}


def weight_bytes(folder: Path) -> int:
    """Bytes of the folder's weight files: what a replica holds once loaded (transformers loads
    a checkpoint in its own dtype)."""
    return sum(p.stat().st_size for pattern in WEIGHT_FILES for p in folder.glob(pattern))


def checked(plan: Plan, world_size: int, config: dict[str, Any]) -> Plan:
    """``plan`` validated for ``world_size`` ranks and the model, as the engine would run it."""
    plan = inference_plan(plan).validate(world_size, config)
    problem = inference_problem(plan)
    if problem:
        raise PlanError(problem)
    return plan


def requested(plan_text: str | None, pool_size: int | None,
              config: dict[str, Any]) -> tuple[Plan | None, int | None]:
    """(plan, ranks) from the command line, checked before any pool starts. A plan without a
    pool size gets a pool of its size; no plan is (None, pool size): ``fitting`` chooses one on
    the started pool, whose size is the pool's default (one rank per GPU, else 2) or given."""
    if pool_size is not None and pool_size < 1:
        raise PlanError(f"--pool-size {pool_size}: a pool needs at least one rank")
    if plan_text is None:
        return None, pool_size
    plan = Plan.parse(plan_text)
    if pool_size is None:
        plan, pool_size = replace(plan, dp=plan.dp or 1), plan.ranks
    return checked(plan, pool_size, config), pool_size


def rank_capacity(ranks: list[dict[str, Any]]) -> int | None:
    """The memory the smallest rank has for a model: its device's, or for a CPU rank its host's
    available memory shared with the other ranks on that host (``rank_calls.rank_memory``
    of each rank)."""
    per_host = Counter(r["host"] for r in ranks)
    sizes = [r["device"] if r["device"] is not None
             else r["host_available"] // per_host[r["host"]] for r in ranks]
    return min(sizes) if sizes else None


def fitting(world_size: int, capacity: int | None, config: dict[str, Any],
            weights: int) -> Plan:
    """Replicas over every rank when a replica's weights fit a rank (``WEIGHT_SHARE`` of its
    ``capacity``), else the narrowest tp that the model's heads allow and that fits."""
    widest = None
    for tp in (t for t in range(1, world_size + 1) if world_size % t == 0):
        try:
            plan = checked(Plan(dp=world_size // tp, tp=tp), world_size, config)
        except PlanError:
            continue
        widest = plan
        if capacity is None or weights / tp <= capacity * WEIGHT_SHARE:
            return plan
    if widest is None:  # tp=1 is refused only for a reason every plan shares: name it
        checked(Plan(dp=world_size), world_size, config)
        raise PlanError(f"no plan serves this model on {world_size} ranks")
    raise PlanError(
        f"the model's weights ({human_bytes(weights)}) do not fit this pool of {world_size} "
        f"ranks: at tp={widest.tp} (the widest its heads allow here) each rank would hold "
        f"{human_bytes(weights / widest.tp)}, more than {WEIGHT_SHARE:.0%} of its "
        f"{human_bytes(capacity)}; start more ranks (--pool-size) or give a --plan that "
        "offloads the weights (offload=auto)")
