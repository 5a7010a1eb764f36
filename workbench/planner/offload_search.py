"""Offload plans for ``recommend`` when nothing fits the device without offload.

Why only then: offload always costs time (exposed PCIe moves, a host-side optimizer, disk), so a
plan that fits without it is faster whenever one exists, and ``recommend`` never proposes one
then. When none fits, every valid plan without a pipeline (offload runs on ZeRO-2/3 chunks,
``validation._check_offload``) is a base at zero 2 and zero 3 (at dp=1 too: one rank offloads to
its own host), the bases whose activations leave the most room first, and each gets:

- static: the smallest fractions off the device that fit, from steps of 1/4 per kind, in order
  of bytes moved off the device (optimizer states first at equal bytes: their step moves to
  the host, they travel once per step; parameters travel every forward and backward);
- auto: ``device_mem`` = the budget less the activations (the runtime's device account holds
  model state and its working buffers, not activations).

Either gets ``host_mem`` = the profile's host memory per rank when what leaves the device does
not fit there (the rest spills to disk).
"""

from __future__ import annotations

import bisect
import itertools
import math

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner.cost_model import Prediction, predict
from workbench.planner.hardware import HardwareProfile
from workbench.planner.offload import Layout
from workbench.planner.setting import Setting
from workbench.planner.spec import ModelSpec

STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_BASES = 4  # layouts (each at zero 2 and 3): the search stays ~1 s on GPT-3
KIB = 2**10


def _bases(valid: list[Prediction]) -> list[tuple[Plan, float]]:
    """(base plan at zero 2 or 3, its activation bytes), least activations first."""
    seen: dict[Plan, float] = {}
    for p in sorted(valid, key=lambda p: p.memory_by_category()["activations"]):
        if p.plan.pp > 1:
            continue
        act = p.memory_by_category()["activations"]
        for zero in (2, 3):
            seen.setdefault(p.plan.with_(zero_stage=zero), act)
        if len(seen) >= 2 * MAX_BASES:
            break
    return list(seen.items())[:2 * MAX_BASES]


def _host_mem(layout: Layout, hw: HardwareProfile) -> int | None:
    """The host budget when what leaves the device does not fit the host (else unlimited)."""
    off = sum(layout.state_bytes(k, t) for k in ("param", "grad", "master", "state")
              for t in ("host", "disk"))
    return int(hw.host_memory) if hw.host_memory and off > hw.host_memory else None


def _off_bytes(sizes: list[float], fraction: float) -> float:
    """Bytes ``static_homes`` sends off the device: whole chunks until the fraction is met."""
    if fraction <= 0:
        return 0.0
    cum = list(itertools.accumulate(sizes))
    return cum[min(len(cum) - 1, bisect.bisect_left(cum, fraction * cum[-1] - 1e-9))]


def _static(base: Plan, act: float, spec: ModelSpec, hw: HardwareProfile, world: int,
            budget: float) -> Plan | None:
    """Device need per combination from prefix sums of each kind's chunk bytes (O(log n)), with
    the working set of everything off the device (its largest: a safe bound); the plan chosen
    is then predicted exactly."""
    plan = base.with_(offload="static", offload_optim=1.0)
    st = Setting(plan, spec, hw, world)
    whole = Layout(st, dict.fromkeys(("params", "grads", "optim"), 1.0))
    kinds = {"params": ["param"], "grads": ["grad"], "optim": ["master", "state"]}
    sizes = {f: [sum(col) for col in zip(*(whole.bytes[k] for k in ks))]
             for f, ks in kinds.items()}
    if whole.aliased:  # the parameter shard is the master: one fraction moves both
        sizes["params"] = [p + m + s for p, m, s in zip(whole.bytes["param"],
                                                        whole.bytes["master"],
                                                        whole.bytes["state"])]
        sizes["optim"] = [0.0] * len(sizes["params"])
    total = sum(sum(v) for v in sizes.values())
    off = {f: {x: _off_bytes(sizes[f], x) for x in STEPS} for f in sizes}
    combos = [dict(zip(("params", "grads", "optim"), f))
              for f in itertools.product(STEPS, repeat=3) if any(f)]
    combos.sort(key=lambda f: (sum(off[k][f[k]] for k in f), f["params"], f["grads"]))
    for f in combos:
        if total - sum(off[k][f[k]] for k in f) + whole.working_set + act <= budget:
            lay = Layout(st, f)
            return base.with_(offload="static", offload_params=f["params"],
                              offload_grads=f["grads"], offload_optim=f["optim"],
                              host_mem=_host_mem(lay, hw))
    return None


def _auto(base: Plan, act: float, spec: ModelSpec, hw: HardwareProfile, world: int,
          budget: float) -> Plan | None:
    room = math.floor((budget - act) / KIB) * KIB
    if room <= 0:
        return None
    st = Setting(base.with_(offload="static", offload_optim=1.0), spec, hw, world)
    whole = Layout(st, dict.fromkeys(("params", "grads", "optim"), 1.0))
    return base.with_(offload="auto", device_mem=room, host_mem=_host_mem(whole, hw))


def offload_plans(valid: list[Prediction], spec: ModelSpec, hw: HardwareProfile, world: int,
                  budget: float) -> tuple[list[Prediction], list[tuple[Plan, str]]]:
    """Predictions of the offload plans tried (see the module docstring), and the refused."""
    out: list[Prediction] = []
    refused: list[tuple[Plan, str]] = []
    for base, act in _bases(valid):
        for make in (_static, _auto):
            try:
                plan = make(base, act, spec, hw, world, budget)
                if plan is not None:
                    out.append(predict(plan, spec, hw, world))
            except PlanError as err:
                refused.append((base.with_(offload="auto" if make is _auto else "static"),
                                str(err)))
    return out, refused
