"""``predict(plan, model, hardware)``: peak memory per rank and tier, and step time, of a plan.

The prediction is the sum of small terms (``MEMORY_TERMS``, ``TIME_TERMS``), each a function
of one ``Setting``. 1D tensor parallelism, 2D / 2.5D grids (``grid``, ``grid_comm``),
sequence parallelism (split_gather, all_to_all, ring), pipeline parallelism (``pipeline``) and
offloading to host and disk (``offload``: ``OFFLOAD_MEMORY_TERMS`` / ``OFFLOAD_TIME_TERMS``
replace the model-state, buffer and optimizer terms) have their terms; every field of a
``Plan`` has one, and what a workload's shape cannot take is refused (``_check_shapes``)
rather than predicted wrongly.

Under pp ranks differ (``_predict_pipelined``): the terms run once per pipeline rank, the
memory is the rank with the largest peak, the time the rank that ends the step last, with the
schedule's idle time on that rank as "bubble" items (replayed by ``pipeline.run_schedule``).

Overlap: gradient collectives start while backward still runs, so their time hides behind the
compute of the same window (``TimeItem.window``), up to the hardware's ``overlap`` fraction of
that compute, except the last collective of the window, which starts only when backward ends.
Ring attention's K/V steps hide the same way behind attention compute alone, and a grid's
in-flight SUMMA broadcasts behind the products of their phase (windows ``*_products``). 1D
tensor-parallel collectives, the grid's reductions and Ulysses all-to-alls have no window: the
next product waits for them. (Windows over the same compute do not share it: ZeRO-2/3's
collectives and a grid's broadcasts could each claim the backward products.) A pipeline's p2p
sends (window ``pipeline``) are asynchronous and overlap other micro-batches; what they delay
is on the schedule's critical path, which the replay prices as a bubble item. Under pp the
data-parallel reduction runs after the schedule, so it has no window. Offload moves (kind
"offload") are exposed in forward and backward (the runtime fetches on demand); in the step the
host optimizer and the disk overlap each other (``offload`` module docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner import (
    expert_terms,
    grid_comm,
    memory,
    offload,
    parallel_comm,
    pipeline,
    timing,
)
from workbench.planner.grid import check_grid
from workbench.planner.hardware import HardwareProfile, get_profile
from workbench.planner.setting import CATEGORIES, TIERS, MemoryItem, Setting, TimeItem
from workbench.planner.spec import ModelSpec

MEMORY_TERMS: list[Callable[[Setting], list[MemoryItem]]] = [  # expert_terms: ep's split
    expert_terms.model_states, memory.activations, expert_terms.activations,
    pipeline.activations, expert_terms.buffers]
TIME_TERMS: list[Callable[[Setting], list[TimeItem]]] = [
    timing.compute, timing.elementwise, timing.optimizer, timing.dp_comm,
    parallel_comm.tp_comm, parallel_comm.sp_comm, grid_comm.grid_comm, pipeline.pp_comm,
    expert_terms.time_items, timing.overhead]
OFFLOAD_MEMORY_TERMS: list[Callable[[Setting], list[MemoryItem]]] = [
    offload.model_states, memory.activations]
OFFLOAD_TIME_TERMS: list[Callable[[Setting], list[TimeItem]]] = [
    offload.device_optimizer if t is timing.optimizer else t for t in TIME_TERMS] + [
    offload.offload_time]
WINDOWS = ("forward", "backward", "backward_last", "forward_attention", "backward_attention",
           "forward_products", "backward_products")


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    memory: list[MemoryItem]
    time: list[TimeItem]
    pipeline: pipeline.PipelineSummary | None = None  # pp > 1: which ranks, the schedule

    @property
    def plan(self) -> Plan:
        return self.setting.plan

    # ---- memory ---------------------------------------------------------------------------
    def memory_by_category(self, tier: str = "device") -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for item in self.memory:
            if item.tier == tier:
                out[item.category] += item.bytes
        return out

    def peak_by_tier(self) -> dict[str, float]:
        return {tier: sum(self.memory_by_category(tier).values()) for tier in TIERS}

    @property
    def peak_bytes(self) -> float:
        """Device-tier peak per rank: what must fit the memory budget."""
        return self.peak_by_tier()["device"]

    @property
    def model_state_bytes(self) -> float:
        """On the device tier."""
        m = self.memory_by_category()
        return m["params"] + m["grads"] + m["optimizer"]

    @property
    def all_tiers_model_state_bytes(self) -> float:
        """Model state on every tier together (what ``memory_breakdown()`` counts)."""
        return sum(i.bytes for i in self.memory if i.category in ("params", "grads",
                                                                   "optimizer"))

    @property
    def measurable_bytes(self) -> float:
        """Model states (on every tier) + activations kept for backward (no transient
        buffers); under pp the largest over the pipeline ranks."""
        if self.pipeline is not None:
            return max(self.pipeline.rank_measurable)
        return self.all_tiers_model_state_bytes + self.memory_by_category()["activations"]

    def moved_bytes(self) -> dict[tuple[str, str], float]:
        """Offload: bytes moved per step between tiers, (from, to); empty without offload."""
        if self.plan.offload == "none":
            return {}
        return dict(offload.layout(self.setting).moved)

    # ---- time -----------------------------------------------------------------------------
    def seconds(self, kind: str, phase: str | None = None) -> float:
        return sum(t.seconds for t in self.time
                   if t.kind == kind and (phase is None or t.phase == phase))

    def exposed_comm(self) -> dict[str, float]:
        """Exposed communication seconds per overlap window ("none" for never hidden)."""
        compute = {"forward": self.seconds("compute", "forward"),
                   "backward": self.seconds("compute", "backward")}
        compute["backward_last"] = compute["backward"] / self.setting.microbatches
        for phase in ("forward", "backward"):
            compute[f"{phase}_attention"] = sum(
                t.seconds for t in self.time
                if t.kind == "compute" and t.phase == phase and "attention" in t.name)
            compute[f"{phase}_products"] = sum(
                t.seconds for t in self.time if t.kind == "compute" and t.phase == phase
                and ("matmuls" in t.name or t.name == "recomputation"))
        # asynchronous p2p sends overlap other micro-batches; their delay on the schedule's
        # critical path is a "bubble" item of the prediction
        out: dict[str, float] = {"pipeline": 0.0} if any(
            t.window == "pipeline" for t in self.time) else {}
        for window in (*WINDOWS, None):
            items = [t for t in self.time if t.kind == "comm" and t.window == window]
            total = sum(t.seconds for t in items)
            if window is None or not items:
                out[window or "none"] = total
                continue
            last = max(t.seconds / t.count for t in items)
            hidden = self.setting.hw.overlap * compute[window]
            out[window] = min(total, max(total - hidden, last))
        return out

    def comm_by_axis(self) -> dict[str, float]:
        """Communication seconds per mesh axis (before overlap)."""
        out: dict[str, float] = {}
        for t in self.time:
            if t.kind == "comm":
                out[t.axis or "?"] = out.get(t.axis or "?", 0.0) + t.seconds
        return out

    @property
    def compute_time(self) -> float:
        return self.seconds("compute")

    @property
    def comm_time(self) -> float:
        return self.seconds("comm")

    @property
    def exposed_comm_time(self) -> float:
        return sum(self.exposed_comm().values())

    @property
    def bubble_time(self) -> float:
        """Seconds the (time) rank idles inside a pipeline schedule; 0 without pp."""
        return self.seconds("bubble")

    @property
    def step_time(self) -> float:
        return (self.compute_time + self.seconds("optimizer") + self.seconds("overhead")
                + self.exposed_comm_time + self.bubble_time + self.seconds("offload"))

    def summary(self) -> str:
        gb = 1e9
        mem = self.memory_by_category()
        parts = ", ".join(f"{k} {v / gb:.3g}" for k, v in mem.items() if v)
        bubble = f", pipeline bubble {self.bubble_time:.3g}" if self.pipeline else ""
        tiers = self.peak_by_tier()
        moved = "" if self.plan.offload == "none" else (
            f", offload moves {self.seconds('offload'):.3g}")
        off = "" if self.plan.offload == "none" else (
            f"; host {tiers['host'] / gb:.3g} GB, disk {tiers['disk'] / gb:.3g} GB")
        return (f"{plan_label(self.plan)}: {self.step_time:.4g} s/step (compute "
                f"{self.compute_time:.3g}, exposed comm {self.exposed_comm_time:.3g} of "
                f"{self.comm_time:.3g}, optimizer {self.seconds('optimizer'):.3g}, overhead "
                f"{self.seconds('overhead'):.3g}{bubble}{moved}); peak "
                f"{self.peak_bytes / gb:.3g} GB per rank ({parts}){off}")


def plan_label(plan: Plan) -> str:
    """Short form of a plan, e.g. ``dp=4 tp=2 sp_mode=split_gather zero=2 bf16 mb=4 ckpt``,
    ``dp=1 tp=8 tp_mode=2.5d tp_depth=2 zero=0 fp32`` or ``dp=2 tp=2 pp=2 schedule=interleaved
    chunks=2 zero=1 bf16 mb=8`` (parses back)."""
    label = f"dp={plan.dp}"
    label += f" tp={plan.tp}" if plan.tp > 1 else ""
    if plan.pp > 1:
        label += f" pp={plan.pp} schedule={plan.pp_schedule}"
        label += f" chunks={plan.pp_chunks}" if plan.pp_schedule == "interleaved" else ""
    label += f" tp_mode={plan.tp_mode}" if plan.tp_mode != "1d" else ""
    label += f" tp_depth={plan.tp_depth}" if plan.tp_depth != 1 else ""
    label += f" sp={plan.sp}" if plan.sp > 1 else ""
    label += f" sp_mode={plan.sp_mode}" if plan.sp_mode != "none" else ""
    label += f" ep={plan.ep}" if plan.ep > 1 else ""
    label += f" zero={plan.zero_stage} {plan.precision}"
    if plan.microbatches > 1:
        label += f" mb={plan.microbatches}"
    label += " ckpt" if plan.activation_checkpointing else ""
    if plan.offload != "none":
        names = ("offload", "device_mem", "host_mem", "offload_params", "offload_grads",
                 "offload_optim")
        label += "".join(f" {item}" for item in plan.to_string().split()
                         if item.partition("=")[0] in names)
    return label


def _check_shapes(plan: Plan, spec: ModelSpec) -> None:
    """What the runtime needs of the workload's shape beyond ``Plan.validate``'s model checks:
    a sequence that splits evenly (ring attention's zig-zag layout: into 2*sp chunks), under
    Ulysses with tp whole heads per tp x sp rank, and under ep experts tp splits evenly
    (``expert_terms.check``)."""
    split = plan.sp * {"split_gather": plan.tp, "ring": 2}.get(plan.sp_mode, 1)
    if spec.seq % split:
        raise PlanError(f"sp_mode={plan.sp_mode} splits the sequence of {spec.seq} tokens "
                        f"into {split} equal parts; choose a sequence length divisible by "
                        f"{split}")
    heads = plan.tp * plan.sp
    if plan.sp_mode == "all_to_all" and plan.tp > 1 and spec.heads % heads:
        raise PlanError(f"sp_mode=all_to_all with tp={plan.tp} gives each tp rank "
                        f"{spec.heads // plan.tp} heads to split over sp={plan.sp}; choose tp*sp "
                        f"dividing the model's {spec.heads} heads, or sp_mode=ring")
    expert_terms.check(plan, spec)


def predict(plan: Plan | str, model: Any, hardware: HardwareProfile | str = "H100",
            world_size: int | None = None) -> Prediction:
    """Predict ``plan`` for ``model`` (ModelSpec, dict or HF config with seq and batch) on
    ``hardware`` (a profile or "A100", "H100", "H200"). ``world_size`` defaults to the product
    of the plan's degrees. Raises ``PlanError`` for a plan the runtime would refuse."""
    plan = Plan.parse(plan)
    spec = ModelSpec.from_config(model)
    hw = get_profile(hardware)
    if world_size is None:
        if plan.dp is None:
            raise PlanError("dp=auto needs world_size: pass world_size= or write dp=N")
        world_size = plan.dp * plan.tp * plan.pp * plan.sp
    plan = plan.validate(world_size, spec.plan_config())
    pipeline.check(plan)
    _check_shapes(plan, spec)
    if not hw.supports(plan.precision):
        raise PlanError(f"precision={plan.precision} has no measured rate on {hw.name}; "
                        f"choose one of {', '.join(hw.matmul_flops)} or calibrate it")
    st = Setting(plan, spec, hw, world_size)
    _ = st.micro_batch  # raises PlanError when microbatches do not divide the batch
    check_grid(st)
    if st.pp > 1:
        return _predict_pipelined(st)
    return Prediction(st, memory_items(st), _time(st))


def memory_items(st: Setting) -> list[MemoryItem]:
    """The memory terms of one rank (``st.pp_rank``'s stage under pp), offload's or not."""
    terms = OFFLOAD_MEMORY_TERMS if st.plan.offload != "none" else MEMORY_TERMS
    return [item for term in terms for item in term(st)]


def _time(st: Setting) -> list[TimeItem]:
    terms = OFFLOAD_TIME_TERMS if st.plan.offload != "none" else TIME_TERMS
    return [item for term in terms for item in term(st)]


def _predict_pipelined(st: Setting) -> Prediction:
    """Every pipeline rank's terms; the memory of the rank with the largest peak, the time of
    the rank whose schedule end plus its work after the schedule (tied embedding, data-parallel
    reduction, optimizer, per-step overhead) is the latest, with its idle time in the schedule
    as bubble items. Its busy time in the replay is, by construction, the sum of its compute,
    tensor-parallel and per-micro-batch overhead items, so its step time is that end plus the
    work after it."""
    run = pipeline.run_schedule(st)
    ranks = [replace(st, pp_rank=r) for r in range(st.pp)]
    plain = [Prediction(r, memory_items(r), _time(r)) for r in ranks]
    after = [p.step_time - run.busy[r] for r, p in enumerate(plain)]
    time_rank = max(range(st.pp), key=lambda r: run.ends[r] + after[r])
    memory_rank = max(range(st.pp), key=lambda r: plain[r].peak_bytes)
    summary = pipeline.PipelineSummary(
        st.plan.pp_schedule, st.pp, st.chunks, st.microbatches, memory_rank, time_rank,
        tuple(r.layers for r in ranks), run.held, run.busy, run.ends,
        tuple(p.peak_bytes for p in plain), tuple(p.measurable_bytes for p in plain))
    time = plain[time_rank].time + pipeline.bubble_items(ranks[time_rank], run)
    return Prediction(ranks[memory_rank], plain[memory_rank].memory, time, summary)
