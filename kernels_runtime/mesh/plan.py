"""``Plan``: how a training or inference job is split over ranks, validated before any rank works.

A plan is written as a string in a notebook (``%%colossal --plan "dp=2 tp=2 zero=1 bf16"``) or
built in code (``Plan(dp=2, tp=2, zero_stage=1, precision="bf16")``). Both routes end in
``Plan.validate(world_size, model_config)``, which names the offending field and a fix for every
impossible combination, so a mistake never reaches a rank as a hang or a shape error.

This module has no torch import: the notebook side parses and validates plans without it.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kernels_runtime.byte_sizes import format_bytes, parse_bytes

# the fields' vocabulary lives in plan_fields.py (validation.py reads it without importing
# this module); every name is re-exported here, where users import it from
from kernels_runtime.mesh.plan_fields import AXES as AXES
from kernels_runtime.mesh.plan_fields import FRACTION_FIELDS, SIZE_FIELDS, PlanError
from kernels_runtime.mesh.plan_fields import OFFLOADS as OFFLOADS
from kernels_runtime.mesh.plan_fields import PP_SCHEDULES as PP_SCHEDULES
from kernels_runtime.mesh.plan_fields import PRECISIONS as PRECISIONS
from kernels_runtime.mesh.plan_fields import SP_MODES as SP_MODES
from kernels_runtime.mesh.plan_fields import TP_MODES as TP_MODES

_ALIASES = {
    "zero": "zero_stage",
    "mb": "microbatches",
    "microbatch": "microbatches",
    "ckpt": "activation_checkpointing",
    "checkpointing": "activation_checkpointing",
    "schedule": "pp_schedule",
    "chunks": "pp_chunks",
    "depth": "tp_depth",
}
_FLAGS = {
    "fp32": ("precision", "fp32"),
    "bf16": ("precision", "bf16"),
    "fp16": ("precision", "fp16"),
    "ckpt": ("activation_checkpointing", True),
    "activation_checkpointing": ("activation_checkpointing", True),
}


@dataclass(frozen=True)
class Plan:
    dp: int | None = None  # None: whatever world_size leaves after tp, pp, sp
    tp: int = 1
    pp: int = 1
    sp: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1  # 2.5d only: number of stacked q x q grids
    # none: no sequence parallelism; split_gather: Megatron SP inside the tp group (sp=1);
    # all_to_all (Ulysses) and ring (ring attention): the sequence split over the sp axis
    sp_mode: str = "none"
    zero_stage: int = 0
    offload: str = "none"
    # per-rank budgets of offload=auto|static in bytes (device_mem=2GiB); beyond both, disk
    device_mem: int | None = None
    host_mem: int | None = None
    # offload=static: the share (0 to 1) of each kind of model state kept off the device
    offload_params: float = 0.0
    offload_grads: float = 0.0
    offload_optim: float = 0.0
    precision: str = "fp32"
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    pp_chunks: int = 1  # model chunks per pipeline rank: V of interleaved (>= 2); zbv uses 2
    activation_checkpointing: bool = False
    # expert-parallel size: each group of ep data-parallel ranks splits the experts of every
    # mixture-of-experts block (ep divides dp; the ranks with one share form the expert-dp group)
    ep: int = 1

    # ---- parsing ------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str | Plan | None) -> Plan:
        """Parse ``"dp=2 tp=2 zero=1 bf16"`` (spaces or commas between items)."""
        if isinstance(text, Plan):
            return text
        values: dict[str, Any] = {}
        names = {f.name: f for f in fields(cls)}
        for item in (text or "").replace(",", " ").split():
            key, sep, raw = item.partition("=")
            key = key.strip().lower().replace("-", "_")
            if not sep:
                if key not in _FLAGS:
                    near = difflib.get_close_matches(key, sorted(_FLAGS), n=2, cutoff=0.6)
                    hint = f"did you mean {' or '.join(near)}? " if near else ""
                    raise PlanError(
                        f"plan item {item!r} is not understood: {hint}write key=value (e.g. "
                        f"dp=2) or a flag ({', '.join(sorted(_FLAGS))})"
                    )
                field_name, value = _FLAGS[key]
                values[field_name] = value
                continue
            field_name = _ALIASES.get(key, key)
            if field_name not in names:
                raise PlanError(_unknown_key(key, sorted(set(names) | set(_ALIASES))))
            values[field_name] = _convert(field_name, raw.strip())
        return cls(**values)

    def to_string(self) -> str:
        """The canonical string form; ``Plan.parse(p.to_string()) == p``."""
        default = Plan()
        items = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v == getattr(default, f.name):
                continue
            if isinstance(v, bool):
                v = "on" if v else "off"
            elif f.name in SIZE_FIELDS:
                v = format_bytes(v)
            elif f.name in FRACTION_FIELDS:
                v = _fraction(v)
            items.append(f"{f.name}={v}")
        return " ".join(items) or "dp=auto"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def ranks(self) -> int:
        """Ranks the plan needs as written: dp*tp*pp*sp, an unset dp counting as 1."""
        return (self.dp or 1) * self.tp * self.pp * self.sp

    # ---- validation ---------------------------------------------------------------------
    def validate(self, world_size: int, model_config: Any = None) -> Plan:
        """Return the plan with dp resolved, or raise PlanError naming the field and a fix."""
        from kernels_runtime.mesh.validation import check_plan

        return check_plan(self, world_size, model_config)

    def with_(self, **changes: Any) -> Plan:
        return replace(self, **changes)


def _fraction(value: float) -> str:
    """Shortest text that parses back to the same float: 0.5, 1, 0.125 (``:g`` would round)."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _convert(name: str, raw: str) -> Any:
    """Convert one ``key=value`` string to the field's type, with a clear error."""
    if name in SIZE_FIELDS:
        try:
            return parse_bytes(raw)
        except ValueError as e:
            raise PlanError(f"{name}={raw!r}: {e}") from None
    if name in FRACTION_FIELDS:
        try:
            return float(raw)
        except ValueError:
            raise PlanError(f"{name}={raw!r} is not a number between 0 and 1 "
                            f"(e.g. {name}=0.5)") from None
    if name == "dp" and raw.lower() == "auto":
        return None
    if name == "activation_checkpointing":
        low = raw.lower()
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        raise PlanError(f"activation_checkpointing={raw!r}: use on or off")
    if name in ("dp", "tp", "pp", "sp", "ep", "tp_depth", "zero_stage", "microbatches",
                "pp_chunks"):
        try:
            return int(raw)
        except ValueError:
            raise PlanError(f"{name}={raw!r} is not an integer (e.g. {name}=2)") from None
    return raw.lower()


def plan_keys() -> list[str]:
    """Every key a plan string accepts (fields and their short aliases), sorted: for messages
    and the notebook's tab completion."""
    return sorted({f.name for f in fields(Plan)} | set(_ALIASES))


def _unknown_key(key: str, known: list[str]) -> str:
    """The message for a key no plan has: the nearest keys first (a typo is the usual cause),
    then every key."""
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(k) for k in near)}? " if near else ""
    return f"plan key {key!r} is unknown; {hint}known keys: {', '.join(known)}"
