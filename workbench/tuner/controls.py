"""One widget per ``Plan`` field, and the plan those widgets describe.

The tuner offers every field, including combinations the runtime refuses: moving a control to
an impossible plan must show why (``Plan.validate``'s own words), not hide the option. Choices
are the values a user would try for the pool's world size; anything else is one ``Plan.parse``
away in a ``%%colossal --plan`` line. The pipeline's controls (stages, schedule, chunks per
rank, micro-batches) are plain fields like the others: the prediction and a measured trial
follow whatever they say, and ``Plan.validate`` explains the combinations a pipeline refuses
(fewer micro-batches than stages, chunks without interleaved, ZeRO-2/3).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import ipywidgets as widgets

from kernels_runtime.byte_sizes import format_bytes
from kernels_runtime.mesh.plan import (
    FRACTION_FIELDS,
    OFFLOADS,
    PP_SCHEDULES,
    PRECISIONS,
    SP_MODES,
    TP_MODES,
    Plan,
)

LABELS = {  # field -> what the control says
    "dp": "data parallel (dp)",
    "tp": "tensor parallel (tp)",
    "pp": "pipeline stages (pp)",
    "sp": "sequence parallel (sp)",
    "tp_mode": "tp mode",
    "tp_depth": "tp depth (2.5d)",
    "sp_mode": "sp mode",
    "zero_stage": "ZeRO stage",
    "offload": "offload",
    "device_mem": "device budget per rank",
    "host_mem": "host budget per rank",
    "offload_params": "params off device (static)",
    "offload_grads": "grads off device (static)",
    "offload_optim": "optimizer off device (static)",
    "precision": "precision",
    "microbatches": "micro-batches",
    "pp_schedule": "pp schedule",
    "pp_chunks": "pp chunks (interleaved)",
    "activation_checkpointing": "activation checkpointing",
    "ep": "expert parallel (ep)",
}


def degree_choices(world_size: int) -> list[int]:
    """Degrees worth trying on ``world_size`` ranks: its divisors, powers of two up to it, and
    one step past it (so the out-of-range message can be seen)."""
    values = {d for d in range(1, world_size + 1) if world_size % d == 0}
    values |= {2**k for k in range(0, world_size.bit_length() + 1)}
    return sorted(values)


def choices(world_size: int) -> dict[str, list[tuple[str, Any]]]:
    """(label, value) options of each dropdown field."""
    degrees = [(str(d), d) for d in degree_choices(world_size)]
    named = {"tp_mode": TP_MODES, "sp_mode": SP_MODES, "offload": OFFLOADS,
             "precision": PRECISIONS, "pp_schedule": PP_SCHEDULES}
    out: dict[str, list[tuple[str, Any]]] = {k: [(v, v) for v in vals] for k, vals in named.items()}
    out.update(dp=[("auto", None), *degrees], tp=degrees, pp=degrees, sp=degrees, ep=degrees,
               tp_depth=[(str(d), d) for d in (1, 2, 4)],
               zero_stage=[(str(z), z) for z in range(4)],
               pp_chunks=[(str(c), c) for c in (1, 2, 3, 4)],
               microbatches=[(str(m), m) for m in (1, 2, 4, 8, 16)])
    budgets = [("unlimited", None), *((format_bytes(b), b) for b in
                                      (2**26, 2**28, 2**30, 2**32, 2**34))]
    out.update(device_mem=budgets, host_mem=[*budgets[:1], ("0 (disk)", 0), *budgets[1:]])
    for name in FRACTION_FIELDS:
        out[name] = [(f"{f:g}", f) for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return out


def make_controls(world_size: int, initial: Plan) -> dict[str, widgets.ValueWidget]:
    """A control for every ``Plan`` field, set to ``initial``'s values."""
    options = choices(world_size)
    style = {"description_width": "11em"}
    layout = widgets.Layout(width="21em")
    controls: dict[str, widgets.ValueWidget] = {}
    for f in fields(Plan):
        value = getattr(initial, f.name)
        if f.name == "activation_checkpointing":
            controls[f.name] = widgets.Checkbox(value=bool(value), description=LABELS[f.name],
                                                style=style, layout=layout, indent=True)
            continue
        controls[f.name] = widgets.Dropdown(options=options[f.name],
                                            description=LABELS[f.name], style=style,
                                            layout=layout)
        set_value(controls[f.name], value)
    return controls


def set_value(control: widgets.ValueWidget, value: Any) -> None:
    """Set a control, first adding a value its menu lacks (e.g. from a given plan)."""
    if isinstance(control, widgets.Dropdown) and all(v != value for _, v in control.options):
        control.options = [*control.options, (str(value), value)]
    control.value = value


def plan_from(values: dict[str, Any]) -> Plan:
    """The (unvalidated) plan of the controls' values."""
    return Plan(**values)
