"""Out of memory on a rank: which rank, which tier, what it had, and the plans that would fit.

Why it exists: a rank that runs out of memory shows torch's raw error ("CUDA out of memory",
"DefaultCPUAllocator: can't allocate memory"), which says how many bytes one allocation wanted
and nothing about what to change. The planner can answer that from the model's shape, the
pool's size and the memory the rank has (``workbench.planner.recommend``), so a failed cell's
error gains: the rank and tier, the budget measured on that rank after the failure, and up to
three plans predicted to fit, each as the ``%%colossal --plan`` line that uses it.

The model: the rank looks in its own namespace (``rank_facts``), where a cell leaves what it
built, for a module ``parallelize`` split (its ``parallel_state``), else the largest module
carrying a Hugging Face config, and sends its config. A namespace rather than a registry kept
by ``parallelize``: the HF ``Trainer`` and Lightning models a cell trains are found too, and no
rank-side global outlives the objects it describes. The planner needs the workload, which no
model holds; the hint assumes one sample per rank per step and says so, with the
``workbench.recommend`` call that takes the real batch and sequence length.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ipyparallel import interactive

TIERS = ("device", "host", "disk")
DEFAULT_SEQ = 1024  # tokens assumed per sample, at most the model's positions
TOP = 3
_HOST_TEXT = ("DefaultCPUAllocator: can't allocate memory", "not enough memory",
              "Cannot allocate memory")
_DEVICE_TEXT = ("CUDA out of memory", "out of memory on device", "HIP out of memory")
_BUDGET_TIER = re.compile(r"\b(device|host|disk)(?: budget|_mem)")


def memory_tier(ename: str, evalue: str) -> str | None:
    """The tier a rank's error says ran out ("device", "host", "disk"), or None when it is
    no out-of-memory error: torch's ``OutOfMemoryError`` (a device), ``MemoryError`` and the
    CPU allocator's RuntimeError (the host), and the runtime's ``BudgetError`` (the tier its
    text names: an offloading plan's device, host or disk budget)."""
    if ename in ("OutOfMemoryError", "CudaOutOfMemoryError"):
        return "device"
    if ename == "BudgetError":
        found = _BUDGET_TIER.search(evalue)
        return found.group(1) if found else "device"
    if ename == "MemoryError":
        return "host"
    if ename == "RuntimeError":
        if any(t in evalue for t in _DEVICE_TEXT):
            return "device"
        if any(t in evalue for t in _HOST_TEXT):
            return "host"
    return None


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} bytes"


def model_workload(config: dict[str, Any]) -> dict[str, Any]:
    """The planner's description of a model config (``model_facts``' ``config``) with the
    assumed workload: one sample per rank of min(positions, DEFAULT_SEQ) tokens."""
    positions = config.get("n_positions") or config.get("max_position_embeddings")
    described = dict(config)
    described.setdefault("seq", min(int(positions), DEFAULT_SEQ) if positions else DEFAULT_SEQ)
    described.setdefault("batch", 1)
    if config.get("model_type") == "gpt2" and positions:
        described.setdefault("positions", positions)
    described.setdefault("attention", config.get("_attn_implementation") or "sdpa")
    return described


def explain(rank: int, tier: str, budget_bytes: float | None, world_size: int,
            model: dict[str, Any] | None, hardware: str = "H100", where: str = "",
            top: int = TOP) -> str:
    """The hint for one rank's out-of-memory error (pure: tests call it without a pool).

    ``budget_bytes``: what the rank can hold in ``tier`` (measured after the failure), None
    when unknown; ``model``: ``model_facts``' record, None when the rank knows no model;
    ``where``: how the budget was measured, in words."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
    budget = f"{_gib(budget_bytes)} per rank" if budget_bytes else "an unknown amount"
    lines = [f"Out of {tier} memory on rank {rank}: it can hold {budget}"
             + (f" ({where})" if where else "") + "."]
    call = (f"workbench.recommend(model_config, world_size={world_size}, "
            f"memory_budget_bytes={budget_bytes or 0:.3g}, batch=..., seq=...)")
    if model is None or not model.get("config"):
        known = "No model is known on this rank" if model is None else (
            f"The rank's {model['type']} `{model['name']}` ({model['params'] / 1e6:.3g} M "
            "parameters) has no config the planner reads (hidden, layers, heads, vocab)")
        lines.append(f"{known}, so no plan is recommended here: in the notebook, {call} "
                     "lists the plans that fit your batch and sequence length "
                     "(workbench.tune(model) to try them).")
        return "\n".join(lines)
    return "\n".join(lines + _plans(model, world_size, budget_bytes, hardware, top, call))


def _plans(model: dict[str, Any], world_size: int, budget_bytes: float | None, hardware: str,
           top: int, call: str) -> list[str]:
    from workbench.planner import NoPlanFitsError, recommend
    from workbench.planner.cost_model import plan_label

    described = model_workload(model["config"])
    label = (f"{model['type']} `{model['name']}` ({model['params'] / 1e6:.3g} M parameters; "
             f"assumed {described['batch']} sample of {described['seq']} tokens per rank per "
             "step)")
    try:
        rec = recommend(described, world_size, budget_bytes, hardware, top=top)
    except (NoPlanFitsError, ValueError) as err:
        return [f"No plan is predicted to fit {label} on {world_size} ranks: {err}",
                f"For your own batch and sequence length: {call}."]
    if not rec.ranked:
        return [f"No plan is predicted to fit {label} on {world_size} ranks.",
                f"For your own batch and sequence length: {call}."]
    out = [f"Plans the planner predicts fit {label} in {_gib(rec.budget)} per rank on "
           f"{world_size} ranks (step times of {rec.hardware.name}):"]
    for i, p in enumerate(rec.ranked[:top], 1):
        out.append(f"  {i}. {plan_label(p.plan)}: peak {_gib(p.peak_bytes)} per rank, "
                   f"{p.step_time:.3g} s/step")
        out.append(f"     use it: %%colossal --plan \"{plan_label(p.plan)}\"")
    out.append(f"For your own batch and sequence length: {call}.")
    return out


def model_facts(namespace: dict[str, Any]) -> dict[str, Any] | None:
    """The model a cell left in ``namespace``: a module ``parallelize`` split (the policy's
    config of it), else the largest module with a Hugging Face config (searched inside
    wrappers: a LightningModule, a peft model); None when there is no module."""
    from torch import nn

    modules = [(k, v) for k, v in list(namespace.items())
               if isinstance(v, nn.Module) and not k.startswith("_")]
    if not modules:
        return None

    def params(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    split = [(k, m) for k, m in modules if getattr(m, "parallel_state", None) is not None]
    name, module = max(split or modules, key=lambda km: params(km[1]))
    config = _hf_config(module)
    if config is None and split:
        state = module.parallel_state
        config = {k: v for k, v in state.policy.model_config(module).items() if v is not None}
    return {"name": name, "type": type(module).__name__, "params": params(module),
            "config": config}


def _hf_config(module: Any) -> dict[str, Any] | None:
    for m in module.modules():
        config = getattr(m, "config", None)
        if hasattr(config, "to_dict"):
            values = config.to_dict()
            values["_attn_implementation"] = getattr(config, "_attn_implementation", None)
            return values
    return None


@interactive
def rank_facts() -> dict[str, Any]:
    """On a rank: what it can hold in each tier now, and the model its namespace holds."""
    import os
    import shutil
    import socket
    import tempfile

    import psutil

    from workbench.cells.oom_hint import model_facts

    session = globals().get("session")
    device = session.state.accelerator.total_memory() if session is not None else None
    spill = os.environ.get("WORKBENCH_SPILL_DIR") or tempfile.gettempdir()
    name = None
    if device is not None:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"device": device, "device_name": name, "host": socket.gethostname(),
            "host_available": psutil.virtual_memory().available,
            "disk_free": shutil.disk_usage(spill).free, "model": model_facts(globals())}


def budget_of(tier: str, facts: dict[str, Any], ranks_on_host: int) -> tuple[float, str]:
    """(bytes per rank, how it was measured) of ``tier`` from ``rank_facts``: the device's
    memory; the host's available memory or disk's free space shared by the host's ranks (a
    CPU rank's device is its host)."""
    share = max(1, ranks_on_host)
    if tier == "device" and facts.get("device"):
        return float(facts["device"]), f"{facts.get('device_name') or 'its device'}'s memory"
    if tier == "disk":
        return facts["disk_free"] / share, (f"free disk of {facts['host']} shared by "
                                            f"{share} ranks")
    return facts["host_available"] / share, (f"available memory of host {facts['host']} "
                                             f"shared by {share} ranks")


def hardware_of(device_name: str | None) -> str:
    """The planner's profile named in the device's name (A100, H100, H200), else H100."""
    for name in ("H200", "H100", "A100"):
        if device_name and name in device_name:
            return name
    return "H100"


def memory_hint(pool: Any, failures: Sequence[Any], timeout_s: float = 10.0) -> str:
    """The hint for a failed cell's out-of-memory ranks ('' when none ran out): one block per
    tier, for the first rank out of it. Never raises: a hint that cannot be built says why,
    and the cell's own error is shown either way."""
    out_of: dict[str, list[int]] = {}
    for f in failures:
        tier = memory_tier(f.ename, f.evalue) if f.kind == "error" else None
        if tier:
            out_of.setdefault(tier, []).append(f.rank)
    blocks = []
    for tier, ranks in out_of.items():
        rank = min(ranks)
        try:
            engine = pool.client[pool.engine_ids[rank]]
            facts = engine.apply_async(rank_facts).get(timeout=timeout_s)
            on_host = sum(1 for r in range(pool.world_size)
                          if pool.host_of(r) == pool.host_of(rank))
            budget, where = budget_of(tier, facts, on_host)
            text = explain(rank, tier, budget, pool.world_size, facts["model"],
                           hardware_of(facts.get("device_name")), where)
        except Exception as err:  # the hint is advice; the error itself must still show
            text = (f"Out of {tier} memory on rank {rank} (no plans listed: asking the rank "
                    f"failed with {type(err).__name__}: {err}).")
        if len(ranks) > 1:
            text += f"\n(ranks {', '.join(map(str, sorted(ranks)))} ran out of {tier} memory)"
        blocks.append(text)
    return "\n\n".join(blocks)
