"""One widget per ``Plan`` field, and the plan those widgets describe.

The tuner offers every field, including combinations the runtime refuses: moving a control to
an impossible plan must show why (``Plan.validate``'s own words), not hide the option. Choices
are the values a user would try for the pool's world size; anything else is one ``Plan.parse``
away in a ``%%colossal --plan`` line. The pipeline's controls (stages, schedule, chunks per
rank, micro-batches) are plain fields like the others: the prediction and a measured trial
follow whatever they say, and ``Plan.validate`` explains the combinations a pipeline refuses
(fewer micro-batches than stages, chunks without interleaved, ZeRO-2/3).

Controls come in groups, one per dimension of a plan (``GROUPS``: data, tensor, pipeline,
sequence, expert, memory, precision), each with its full label and a tooltip saying what the
field does. Labels take their natural width (``description_width: initial``): a fixed label
column clipped the long ones ("activation ch...") in the browser.

A field's ``None`` (dp auto, an unlimited budget) is held in its menu as ``AUTO``: ipywidgets
shows a ``None`` value as an empty menu (its index becomes ``None``), so "auto" and
"unlimited" would read as blank; ``read`` and ``set_value`` translate at the edge.
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

TOOLTIPS = {  # field -> what hovering the control explains
    "dp": "data-parallel replicas: each holds a copy of the model and a share of the batch; "
          "auto takes what tp x pp x sp leave of the ranks",
    "zero_stage": "ZeRO shards model state over the data ranks: 1 optimizer states, "
                  "2 + gradients, 3 + parameters (gathered per block when needed)",
    "microbatches": "micro-batches each data-parallel rank's batch is split into: gradient "
                    "accumulation, and what a pipeline schedule streams through its stages",
    "tp": "tensor-parallel ranks splitting every weight matrix (heads, MLP columns)",
    "tp_mode": "1d: Megatron row/column split; 2d: SUMMA on a q x q grid; 2.5d: d stacked "
               "q x q grids",
    "tp_depth": "2.5d only: the number d of stacked q x q grids (tp = d*q*q)",
    "pp": "pipeline stages: consecutive blocks on different ranks, micro-batches streamed",
    "pp_schedule": "the order stages run micro-batches: gpipe, 1f1b, interleaved (several "
                   "chunks per rank), zbv (zero-bubble V)",
    "pp_chunks": "model chunks per pipeline rank (interleaved schedule only)",
    "sp": "ranks the sequence is split over (the sp axis): Ulysses all-to-all or ring "
          "attention",
    "sp_mode": "none; split_gather: Megatron sequence parallelism inside the tp group (sp=1); "
               "all_to_all (Ulysses) or ring over the sp axis",
    "ep": "expert-parallel ranks splitting the experts of every mixture-of-experts block; "
          "ep divides dp",
    "activation_checkpointing": "keep only each block's input and recompute the block in "
                                "backward: less activation memory, one more forward",
    "offload": "move model state off the device: static (fixed shares below) or auto "
               "(evict under the device budget)",
    "device_mem": "offload: device memory per rank the model state may use",
    "host_mem": "offload: host memory per rank; beyond it state spills to disk",
    "offload_params": "offload=static: share of the parameters kept off the device",
    "offload_grads": "offload=static: share of the gradients kept off the device",
    "offload_optim": "offload=static: share of the optimizer states kept off the device",
    "precision": "compute dtype: fp32, or bf16 / fp16 with fp32 master weights",
}

GROUPS = {  # dimension -> its fields, in the order shown
    "data": ("dp", "zero_stage", "microbatches"),
    "tensor": ("tp", "tp_mode", "tp_depth"),
    "pipeline": ("pp", "pp_schedule", "pp_chunks"),
    "sequence": ("sp", "sp_mode"),
    "expert": ("ep",),
    "memory": ("activation_checkpointing", "offload", "device_mem", "host_mem",
               "offload_params", "offload_grads", "offload_optim"),
    "precision": ("precision",),
}
LABEL_STYLE = {"description_width": "initial"}  # a label as wide as its text, never clipped


class _Auto:
    """A menu value standing for a plan field's ``None`` (see the module's docstring)."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _Auto()


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
    """A control for every ``Plan`` field, set to ``initial``'s values, with its full label
    and tooltip."""
    options = choices(world_size)
    controls: dict[str, widgets.ValueWidget] = {}
    for f in fields(Plan):
        value = getattr(initial, f.name)
        common = dict(description=LABELS[f.name], tooltip=TOOLTIPS[f.name], style=LABEL_STYLE,
                      layout=widgets.Layout(width="auto"))
        if f.name == "activation_checkpointing":
            controls[f.name] = widgets.Checkbox(value=bool(value), indent=False, **common)
            continue
        controls[f.name] = widgets.Dropdown(
            options=[(label, AUTO if v is None else v) for label, v in options[f.name]],
            **common)
        set_value(controls[f.name], value)
    return controls


def grouped(controls: dict[str, widgets.Widget],
            extra: dict[str, list[widgets.Widget]] | None = None) -> widgets.Widget:
    """The controls in one box per dimension (``GROUPS``), titled, wrapping to the cell's
    width; ``extra`` adds groups (the hardware the prediction is for)."""
    missing = sorted(set(controls) - {n for names in GROUPS.values() for n in names})
    if missing:  # a new Plan field must be placed in a group, or it would not be shown
        raise ValueError(f"plan fields without a group: {', '.join(missing)}; add them to "
                         "controls.GROUPS")
    boxes = [(name, [controls[n] for n in names]) for name, names in GROUPS.items()]
    boxes += list((extra or {}).items())
    return widgets.GridBox(
        [widgets.VBox([widgets.HTML(f"<b>{name}</b>"), *members],
                      layout=widgets.Layout(border="1px solid #ddd", padding="2px 6px"))
         for name, members in boxes],
        layout=widgets.Layout(grid_template_columns="repeat(auto-fill, minmax(22em, 1fr))",
                              grid_gap="6px"))


def read(control: widgets.ValueWidget) -> Any:
    """The plan value a control shows (``None`` for its "auto" / "unlimited" entry)."""
    return None if control.value is AUTO else control.value


def set_value(control: widgets.ValueWidget, value: Any) -> None:
    """Set a control, first adding a value its menu lacks (e.g. from a given plan)."""
    value = AUTO if value is None and isinstance(control, widgets.Dropdown) else value
    if isinstance(control, widgets.Dropdown) and all(v != value for _, v in control.options):
        control.options = [*control.options, (str(value), value)]
    control.value = value


def plan_from(values: dict[str, Any]) -> Plan:
    """The (unvalidated) plan of the controls' values."""
    return Plan(**values)
