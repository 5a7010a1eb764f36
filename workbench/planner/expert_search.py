"""Expert parallelism in ``recommend``'s search: the ep each candidate may take, and why it won.

Why a file of its own: ep is a fifth factor only for a mixture of experts, and it composes with
part of the search space alone, so the rules for it sit in one place beside its cost terms
(``expert_terms``). A candidate gets ep over the divisors of its data-parallel size that also
divide the model's experts (ep groups are carved out of the dp ranks, ``Plan.validate``), on
what the runtime's expert applier composes with: dp and ZeRO 0-3, 1D tp (dividing the experts'
intermediate size, ``expert_terms.check``), pp with any schedule, checkpointing. Not on sp or
sp_mode or a 2D / 2.5D grid (``Plan.validate`` refuses them), nor offload: the runtime offloads
under ep, but the planner's offload terms (``offload.py``) count the dense layout's one MLP
per block, not the experts, so ``recommend`` keeps its offload search to ep=1 bases. A dense
model (``experts == 0``) never gets ep > 1.

Why ep can win: its memory (a rank holds ``experts / ep`` experts of each block: their state
below ZeRO-3, their gathered blocks and gradient buffers under ZeRO-3) and its gradient traffic
(the experts reduce over dp / ep ranks) against the all-to-alls it adds (``expert_terms``).
``explain`` says which of these decided, in numbers.
"""

from __future__ import annotations

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner import memory
from workbench.planner.cost_model import Prediction, plan_label, predict
from workbench.planner.expert_terms import local_params
from workbench.planner.spec import ModelSpec

GB = 1e9


def ep_values(dp: int, experts: int) -> list[int]:
    """The ep > 1 a plan with ``dp`` data-parallel ranks can take on ``experts`` experts."""
    return [e for e in range(2, dp + 1) if dp % e == 0 and experts % e == 0]


def composes(plan: Plan) -> bool:
    """Whether the runtime runs ep beside the rest of ``plan`` (see the module docstring)."""
    return plan.sp == 1 and plan.sp_mode == "none" and plan.tp_mode == "1d" \
        and plan.offload == "none"


def expert_plans(plans: list[Plan], spec: ModelSpec, ep: int | None = None) -> list[Plan]:
    """Each plan of ``plans`` that ep composes with, at every ep > 1 it can take (only ``ep``
    if given); none for a dense model."""
    if not spec.experts:
        return []
    return [plan.with_(ep=e) for plan in plans if composes(plan) and plan.dp
            for e in ep_values(plan.dp, spec.experts) if ep is None or e == ep]


def expert_state_bytes(p: Prediction) -> float:
    """Device bytes of this rank's expert parameters, gradients and optimizer states (the
    experts' part of ``expert_terms.model_states``)."""
    st = p.setting
    expert = local_params(st)[1]
    edp = st.data_ranks // st.plan.ep
    return sum(memory.runtime_model_state_bytes(expert, edp, st.plan.zero_stage,
                                                st.plan.precision))


def _without_ep(p: Prediction) -> Prediction | None:
    """The same plan at ep=1 (always valid when the plan with ep is)."""
    try:
        return predict(p.plan.with_(ep=1), p.setting.spec, p.setting.hw, p.setting.world)
    except PlanError:
        return None


def _a2a_seconds(p: Prediction) -> float:
    return p.comm_by_axis().get("ep", 0.0)


def explain(best: Prediction, fits: list[Prediction], over: list[Prediction],
            invalid: list[tuple[Plan, str]], spec: ModelSpec, budget: float) -> str | None:
    """One line on ep for a mixture of experts (None for a dense model): what the chosen ep
    halves (or divides) and what its all-to-alls cost, against the same plan at ep=1; or, when
    the best plan has ep=1, why no ep plan beat it."""
    if not spec.experts:
        return None
    if best.plan.ep > 1:
        return _chosen(best, budget)
    with_ep = [p for p in fits if p.plan.ep > 1]
    if with_ep:
        q = with_ep[0]
        slower = q.step_time / best.step_time - 1
        return (f"ep: not chosen; the fastest ep plan within the budget, {plan_label(q.plan)}, "
                f"is predicted {slower:.1%} slower ({q.step_time:.3g} s; its all-to-alls cost "
                f"{_a2a_seconds(q):.3g} s per step)")
    heavy = [p for p in over if p.plan.ep > 1]
    if heavy:
        q = min(heavy, key=lambda p: p.peak_bytes)
        return (f"ep: not chosen; every ep plan is over the budget (the smallest, "
                f"{plan_label(q.plan)}, needs {q.peak_bytes / GB:.3g} GB per rank)")
    refused = sorted({why for plan, why in invalid if plan.ep > 1})
    if refused:
        return f"ep: not chosen; the runtime refuses every ep plan here: {refused[0]}"
    return (f"ep: not tried; ep splits the {spec.experts} experts over data-parallel ranks and "
            "needs dp > 1 with ep dividing both dp and the experts, beside no sp, no 2D / 2.5D "
            "grid and no offload")


def _chosen(best: Prediction, budget: float) -> str:
    ep, spec = best.plan.ep, best.setting.spec
    base = _without_ep(best)
    held = f"{spec.experts // ep} of {spec.experts} experts per block"
    line = f"ep: ep={ep} holds {held} on each rank"
    if base is None:
        return line
    line += (f": the experts' state {expert_state_bytes(base) / GB:.3g} GB -> "
             f"{expert_state_bytes(best) / GB:.3g} GB, the peak {base.peak_bytes / GB:.3g} GB -> "
             f"{best.peak_bytes / GB:.3g} GB per rank, for {_a2a_seconds(best):.3g} s of "
             f"all-to-alls per step; without ep ({plan_label(base.plan)})")
    if base.peak_bytes > budget:
        return line + f" it would not fit the {budget / GB:.3g} GB budget"
    faster = 1 - best.step_time / base.step_time
    return line + (f" it takes {base.step_time:.3g} s, {best.step_time:.3g} s with ep "
                   f"({faster:.0%} faster; {_largest_changes(base, best)})")


def _largest_changes(base: Prediction, best: Prediction) -> str:
    """The two time items ep changed most, e.g. "expert gradient all-reduce -0.2 s"."""
    def by_name(p: Prediction) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in p.time:
            out[t.name] = out.get(t.name, 0.0) + t.seconds
        return out

    a, b = by_name(base), by_name(best)
    deltas = sorted(((abs(b.get(k, 0.0) - a.get(k, 0.0)), k) for k in {*a, *b}), reverse=True)
    return ", ".join(f"{k} {b.get(k, 0.0) - a.get(k, 0.0):+.3g} s" for d, k in deltas[:2] if d)
