"""Which plans the inference engine serves, decided without torch.

The engine checks its plan on the ranks; ``workbench serve`` checks the same plan before it
starts a pool, so a plan the engine would refuse costs the user no pool start. Kept torch-free
for that second caller.
"""

from __future__ import annotations

from dataclasses import replace

from kernels_runtime.mesh.plan import Plan
from kernels_runtime.mesh.validation import pipeline_chunks


def inference_plan(plan: Plan | str | None) -> Plan:
    """``plan`` as the engine runs it: micro-batches are a training notion, so a pipeline's
    check for enough of them (so stages do not idle) has nothing to check here."""
    plan = Plan.parse(plan if plan is not None else Plan())
    return replace(plan, microbatches=max(plan.microbatches, plan.pp))


def inference_problem(plan: Plan) -> str | None:
    """Why ``plan`` (validated: dp resolved) cannot serve inference, or None."""
    if plan.tp_mode != "1d":
        return (f"the inference engine runs 1D tensor parallelism; tp_mode={plan.tp_mode} "
                "splits heads over a grid it does not page yet: use tp_mode=1d")
    if plan.sp > 1:
        return ("sequence parallelism splits one sequence over ranks for training; for "
                "inference use tp, pp or dp replicas (sp=1)")
    if plan.pp > 1 and pipeline_chunks(plan) > 1:
        return (f"inference runs one chunk per pipeline stage; pp_schedule={plan.pp_schedule} "
                "has several: use pp_schedule=1f1b or gpipe")
    if plan.dp > 1 and (plan.zero_stage == 3 or plan.offload != "none"):
        return ("data-parallel replicas serve their own requests, so each holds its whole "
                "model: zero=3 and offload shard weights over dp; use dp=1 with offload (or "
                "pp/tp to split the model), or zero<=2 without offload for replicas")
    return None
