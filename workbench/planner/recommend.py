"""``recommend(model, world_size, budget)``: the fastest plan that fits, and why, in words.

Candidates factor ``world_size`` into dp x tp x sp: 1D tensor parallelism (plain, or with
Megatron sequence parallelism, sp_mode=split_gather), 2D and 2.5D grids (every q x q and
q x q x d shape of tp, ``grid.grid_shapes``), sequence parallelism over the sp axis (Ulysses
all-to-all or ring attention), and data parallelism over the rest with ZeRO 0-3; each precision
the hardware has a rate for, micro-batch counts dividing the per-rank batch, and activation
checkpointing on or off. Pipelines (``pipeline_plans``) factor it into dp x pp x tp instead:
pp over the divisors, with 1D tp (what the runtime's stages support), every schedule (gpipe,
1f1b, interleaved with 2 or 4 chunks per rank, zbv) the model's blocks allow, at least pp
micro-batches, ZeRO 0 or 1. A mixture of experts adds expert parallelism (``expert_search``):
each plan ep composes with (no sp, no grid, no offload) again at every ep dividing its dp and
the experts, and the text says why ep was chosen or not; a dense model never gets ep. Every
candidate goes through ``Plan.validate`` (with the model's head counts) and the cost model;
invalid ones are kept with the reason, those over the memory budget to explain what the budget
excluded. Only when no plan fits without offload, offload plans (``offload_search``: static with
the smallest fractions that fit, auto with ``device_mem`` at the budget) are tried and the text
says why; if none fits either, the error says what the smallest plan needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kernels_runtime.mesh.plan import PRECISIONS, Plan, PlanError
from workbench.planner.activations import profile_for
from workbench.planner.cost_model import Prediction, plan_label, predict
from workbench.planner.expert_search import expert_plans
from workbench.planner.expert_search import explain as explain_ep
from workbench.planner.grid import grid_shapes
from workbench.planner.hardware import HardwareProfile, get_profile
from workbench.planner.offload import layout as offload_layout
from workbench.planner.offload_search import offload_plans
from workbench.planner.spec import ModelSpec

GB = 1e9


class NoPlanFitsError(PlanError):
    """No valid plan fits the memory budget; ``smallest`` is the plan needing the least."""

    def __init__(self, message: str, smallest: Prediction | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


Layout = tuple[int, int, str, str, int]  # tp, sp, sp_mode, tp_mode, tp_depth


def layouts(world_size: int) -> list[Layout]:
    """(tp, sp, sp_mode, tp_mode, tp_depth) of every way to split ``world_size`` ranks: plain
    1D tp and tp with split_gather (sp = 1), tp on each grid shape it has (sp = 1: the grid
    does not combine with the sp axis), and sp over its axis by all_to_all or ring, with or
    without 1D tp."""
    out: list[Layout] = []
    for tp in _divisors(world_size):
        for sp in _divisors(world_size // tp):
            if sp == 1:
                out += [(tp, 1, "none", "1d", 1)]
                out += [(tp, 1, "split_gather", "1d", 1)] if tp > 1 else []
                out += [(tp, 1, "none", mode, depth) for mode, depth in grid_shapes(tp)]
            else:
                out += [(tp, sp, "all_to_all", "1d", 1), (tp, sp, "ring", "1d", 1)]
    return out


def _holds(spec: ModelSpec, replicas: int, dp: int | None) -> bool:
    """Whether ``replicas`` data-parallel replicas are asked for and can split the batch."""
    if dp is not None and replicas != dp:
        return False
    return spec.batch is not None or spec.global_batch is None \
        or spec.global_batch % replicas == 0


def candidate_plans(world_size: int, spec: ModelSpec, precisions: tuple[str, ...],
                    max_microbatches: int = 16, dp: int | None = None,
                    pp: int | None = None, ep: int | None = None) -> list[Plan]:
    """Every plan of the search space (validated later, one by one), only those with ``dp``
    data-parallel replicas, ``pp`` pipeline stages and ``ep`` expert-parallel ranks if given.
    Layouts whose dp does not divide a global batch are left out: they cannot hold the
    workload at all. A mixture of experts adds each plan at every ep it can take
    (``expert_search``)."""
    plans = _plans(world_size, spec, precisions, max_microbatches, dp, pp)
    with_ep = expert_plans(plans, spec, ep)
    return with_ep if ep is not None and ep > 1 else plans + with_ep


def _plans(world_size: int, spec: ModelSpec, precisions: tuple[str, ...],
           max_microbatches: int, dp: int | None, pp: int | None) -> list[Plan]:
    """``candidate_plans`` at ep=1."""
    plans = pipeline_plans(world_size, spec, precisions, max_microbatches, dp) \
        if pp != 1 else []
    if pp is not None:
        plans = [p for p in plans if p.pp == pp]
        if pp > 1:
            return plans
    for tp, sp, mode, tp_mode, depth in layouts(world_size):
        replicas = world_size // (tp * sp)
        if not _holds(spec, replicas, dp):
            continue
        batch = spec.local_batch(replicas)
        micro = [m for m in range(1, min(batch, max_microbatches) + 1) if batch % m == 0]
        stages = (0, 1, 2, 3) if replicas > 1 else (0,)
        plans += [Plan(dp=replicas, tp=tp, sp=sp, sp_mode=mode, tp_mode=tp_mode,
                       tp_depth=depth, zero_stage=z, precision=p, microbatches=m,
                       activation_checkpointing=ckpt)
                  for p in precisions for z in stages for m in micro for ckpt in (False, True)]
    return plans


# (schedule, pp_chunks, model chunks per rank) of the pipelines tried
SCHEDULES = (("gpipe", 1, 1), ("1f1b", 1, 1), ("interleaved", 2, 2), ("interleaved", 4, 4),
             ("zbv", 1, 2))


def pipeline_plans(world_size: int, spec: ModelSpec, precisions: tuple[str, ...],
                   max_microbatches: int = 16, dp: int | None = None) -> list[Plan]:
    """dp x pp x tp plans with pp > 1: every schedule whose pp x chunks fits the model's
    blocks, micro-batch counts from pp up (interleaved: multiples of pp) dividing the
    replica's batch, ZeRO 0 or 1 (a pipeline keeps gradients until its last backward, so
    ZeRO-2/3 would only add traffic; ``Plan.validate`` refuses them)."""
    plans = []
    for pp in _divisors(world_size)[1:]:
        for tp in _divisors(world_size // pp):
            replicas = world_size // (tp * pp)
            if not _holds(spec, replicas, dp):
                continue
            batch = spec.local_batch(replicas)
            micro = [m for m in range(pp, min(batch, max_microbatches) + 1) if batch % m == 0]
            stages = (0, 1) if replicas > 1 else (0,)
            for name, chunks, per_rank in SCHEDULES:
                if pp * per_rank > spec.layers:
                    continue
                plans += [Plan(dp=replicas, tp=tp, pp=pp, pp_schedule=name, pp_chunks=chunks,
                               zero_stage=z, precision=p, microbatches=m,
                               activation_checkpointing=ckpt)
                          for p in precisions for z in stages for ckpt in (False, True)
                          for m in micro if name != "interleaved" or m % pp == 0]
    return plans


@dataclass
class Recommendation:
    ranked: list[Prediction]  # plans within the budget, fastest first
    over_budget: list[Prediction]  # valid plans that do not fit, fastest first
    invalid: list[tuple[Plan, str]]  # candidates the runtime refuses, with the reason
    budget: float
    hardware: HardwareProfile
    spec: ModelSpec
    world_size: int
    top: int = 3
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    @property
    def plan(self) -> Plan:
        return self.best.plan

    def explain(self, top: int | None = None) -> str:
        top = top or self.top
        lines = [f"{self.world_size} ranks of {self.hardware.name}; {self.spec.describe()}; "
                 f"activations counted as {profile_for(self.spec).name}; budget "
                 f"{self.budget / GB:.3g} GB per rank: {len(self.ranked)} of "
                 f"{len(self.ranked) + len(self.over_budget)} valid plans fit."]
        for i, p in enumerate(self.ranked[:top], 1):
            lines.append(f"{i}. {_line(p, self.budget)}")
            lines.append(f"   why: {self._why(p, i)}")
        return "\n".join(lines + self.notes)

    def _why(self, p: Prediction, rank: int) -> str:
        comm_share = p.exposed_comm_time / p.step_time
        bound = (f"communication-bound: exposed communication is {comm_share:.0%} of the step"
                 if comm_share > 0.3 else
                 f"compute-bound: {p.compute_time / p.step_time:.0%} of the step is compute, "
                 f"{p.comm_time:.3g} s of communication of which {p.exposed_comm_time:.3g} s "
                 "is not hidden behind backward")
        if p.plan.offload != "none":
            links = offload_layout(p.setting).link_bytes()
            tiers = p.peak_by_tier()
            bound += (f"; offload: host {tiers['host'] / GB:.3g} GB, disk "
                      f"{tiers['disk'] / GB:.3g} GB per rank, {links['pcie'] / GB:.3g} GB over "
                      f"PCIe and {(links['disk_read'] + links['disk_write']) / GB:.3g} GB of "
                      f"disk I/O per step cost {p.seconds('offload'):.3g} s "
                      f"({p.seconds('offload') / p.step_time:.0%} of the step)")
        if p.pipeline is not None:
            s = p.pipeline
            bound += (f"; pipeline bubble {p.bubble_time / p.step_time:.0%} of the step "
                      f"({s.schedule}, {s.stages} stages, {s.microbatches} micro-batches), "
                      f"stage {s.memory_rank} holds the most")
        if rank > 1:
            best = self.best
            slower = p.step_time / best.step_time - 1
            return (f"{slower:.0%} slower than #1 ({_differences(p, best)}); "
                    f"{_memory_delta(p, best)}; {bound}")
        faster = [q for q in self.over_budget if q.step_time < p.step_time]
        excluded = ""
        if faster:
            q = faster[0]
            excluded = (f"; the faster {plan_label(q.plan)} ({q.step_time:.3g} s) needs "
                        f"{q.peak_bytes / GB:.3g} GB, over the budget")
        return f"fastest plan within the budget{excluded}; {bound}"

    def __str__(self) -> str:
        return self.explain()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.explain())


def _line(p: Prediction, budget: float) -> str:
    mem = p.memory_by_category()
    parts = ", ".join(f"{k} {v / GB:.3g}" for k, v in mem.items() if v)
    bubble = f", bubble {p.bubble_time:.3g} s" if p.pipeline is not None else ""
    return (f"{plan_label(p.plan)}: {p.step_time:.4g} s/step (compute {p.compute_time:.3g} s, "
            f"exposed comm {p.exposed_comm_time:.3g} s, optimizer {p.seconds('optimizer'):.3g}"
            f" s, overhead {p.seconds('overhead'):.3g} s{bubble}); peak {p.peak_bytes / GB:.3g} "
            f"GB per rank = {p.peak_bytes / budget:.0%} of budget ({parts} GB)")


def _components(p: Prediction) -> dict[str, float]:
    return {"matmuls": p.seconds("compute") - _memory_bound(p),
            "memory-bound ops": _memory_bound(p), "exposed communication": p.exposed_comm_time,
            "optimizer": p.seconds("optimizer"), "overhead": p.seconds("overhead"),
            "pipeline bubble": p.bubble_time}


def _memory_bound(p: Prediction) -> float:
    return sum(t.seconds for t in p.time if t.kind == "compute" and "memory-bound" in t.name)


def _differences(p: Prediction, best: Prediction) -> str:
    mine, theirs = _components(p), _components(best)
    deltas = sorted(((mine[k] - theirs[k], k) for k in mine), reverse=True)
    return ", ".join(f"{k} {d:+.3g} s" for d, k in deltas[:2] if abs(d) > 0) or "same costs"


def _memory_delta(p: Prediction, best: Prediction) -> str:
    d = best.peak_bytes - p.peak_bytes
    if abs(d) < 0.0005 * GB:
        return "same memory"
    return f"saves {d / GB:.3g} GB per rank" if d > 0 else f"needs {-d / GB:.3g} GB more"


def per_step_workload(spec: ModelSpec, world_size: int) -> ModelSpec:
    """Fix the samples per step whatever the plan: a per-rank ``batch`` is read as the global
    batch pure data parallelism over ``world_size`` ranks would run. Otherwise a plan with tp
    or sp (fewer data-parallel ranks) would do less work per step and look faster."""
    if spec.batch is None:
        return spec
    return replace(spec, batch=None, global_batch=spec.batch * world_size)


def recommend(
    model_config: Any,
    world_size: int,
    memory_budget_bytes: float | None = None,
    hardware: HardwareProfile | str = "H100",
    *,
    precisions: tuple[str, ...] | None = None,
    max_microbatches: int = 16,
    top: int = 3,
    dp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    offload: bool = True,
    **workload: Any,
) -> Recommendation:
    """Rank the plans the cost model predicts (dp x tp x sp with ZeRO, 1D tp or a 2D / 2.5D
    grid, dp x pp x tp pipelines with their schedules, precisions, micro-batches,
    checkpointing) by predicted step time under
    ``memory_budget_bytes`` per rank (default: the hardware's device memory) and explain the
    ``top`` ones.

    ``model_config``: ModelSpec, dict or HF config; ``workload`` overrides (seq=, batch=,
    global_batch=); a per-rank batch fixes the global batch (``per_step_workload``). ``dp``
    fixes the data-parallel degree: ``dp=1`` puts every rank on one model replica, the
    strong-scaling question of the tensor-parallelism papers. (A 2.5D grid's depth is data
    parallelism over replicated weight blocks, so with dp free it competes with dp x 2D: the
    same blocks, gradients summed per micro-batch in the compute dtype instead of once per
    step in fp32.) ``pp`` fixes the pipeline stages the same way (``pp=1``: no pipeline), and
    ``ep`` the expert-parallel ranks of a mixture of experts (searched over the divisors of dp
    that divide the experts when not given; a dense model only has ep=1; ``expert_search``).
    When nothing fits, offload plans are tried (``offload=False``: not).
    Raises ``NoPlanFitsError`` naming the smallest need when nothing fits.
    """
    spec = per_step_workload(ModelSpec.from_config(model_config, **workload), world_size)
    hw = get_profile(hardware)
    budget = float(memory_budget_bytes if memory_budget_bytes is not None else hw.device_memory)
    precisions = tuple(p for p in (precisions or PRECISIONS) if hw.supports(p))
    if not precisions:
        raise PlanError(f"none of the requested precisions has a rate on {hw.name}")
    notes = []
    if "bf16" in precisions and "fp16" in precisions and \
            hw.forward_flops("fp16") <= hw.forward_flops("bf16"):
        precisions = tuple(p for p in precisions if p != "fp16")
        notes.append("fp16 left out: no faster than bf16 here, and it needs loss scaling")
    if ep is not None and ep > 1 and not spec.experts:
        raise PlanError(f"ep={ep} splits the experts of mixture-of-experts blocks, and this "
                        "model description has none; give experts= and top_k= (an HF config's "
                        "num_local_experts / num_experts_per_tok), or leave ep out")
    valid: list[Prediction] = []
    invalid: list[tuple[Plan, str]] = []
    for name, value in (("dp", dp), ("pp", pp), ("ep", ep)):
        if value is not None:
            notes.append(f"only plans with {name}={value} were considered")
    for plan in candidate_plans(world_size, spec, precisions, max_microbatches, dp, pp, ep):
        try:
            valid.append(predict(plan, spec, hw, world_size))
        except PlanError as err:
            invalid.append((plan, str(err)))
    if not valid:
        reasons = "; ".join(sorted({r for _, r in invalid}))
        raise NoPlanFitsError(f"no plan is valid on {world_size} ranks: {reasons}")
    valid.sort(key=lambda p: (p.step_time, p.peak_bytes))
    fits = [p for p in valid if p.peak_bytes <= budget]
    over = [p for p in valid if p.peak_bytes > budget]
    if not fits:  # only then offload: a plan that fits without it is faster
        smallest = min(valid, key=lambda p: p.peak_bytes)
        if not offload:
            raise NoPlanFitsError(
                f"no plan fits {budget / GB:.3g} GB per rank on {world_size} ranks: the "
                f"smallest need is {smallest.peak_bytes / GB:.3g} GB per rank, by "
                f"{_line(smallest, budget)}. Raise the budget, add ranks, shorten the sequence "
                "or the batch, or allow offload.", smallest)
        # ep=1 bases only: the offload terms count the dense layout (expert_search docstring)
        tried, refused = offload_plans([p for p in valid if p.plan.ep == 1], spec, hw,
                                       world_size, budget)
        invalid += refused
        fits = sorted((p for p in tried if p.peak_bytes <= budget),
                      key=lambda p: (p.step_time, p.peak_bytes))
        if not fits:
            raise NoPlanFitsError(
                f"no plan fits {budget / GB:.3g} GB per rank on {world_size} ranks, with or "
                f"without offload: the smallest need without offload is "
                f"{smallest.peak_bytes / GB:.3g} GB per rank, by {_line(smallest, budget)}. "
                "Raise the budget, add ranks, or shorten the sequence or the batch.", smallest)
        notes.append(
            f"no plan fits {budget / GB:.3g} GB per rank without offload (the smallest need is "
            f"{smallest.peak_bytes / GB:.3g} GB, by {plan_label(smallest.plan)}), so model "
            "state goes off the device: offload=static with the smallest fractions of "
            "parameters, gradients and optimizer states that fit, or offload=auto with "
            "device_mem = the budget less activations; they pay for PCIe moves, host Adam and "
            "disk I/O in step time")
    why_ep = explain_ep(fits[0], fits, over, invalid, spec, budget)
    notes += [why_ep] if why_ep else []
    return Recommendation(fits, over, invalid, budget, hw, spec, world_size, top, notes)
