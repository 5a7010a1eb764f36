"""Expert parallelism's cost terms: the experts' model state divided over ep, and the all-to-alls.

Why a file of its own: a mixture-of-experts block keeps ``experts`` MLPs where a dense block
keeps one, and an ep group of ranks (carved out of the data-parallel ranks, as Megatron's and
ColossalAI's expert parallelism; ``kernels_runtime.parallel.expert``) splits them, so a plan's
memory and communication change in two places only, both here:

- Model state (``model_states``, which replaces ``memory.model_states`` in the cost model's
  list and returns it unchanged for a dense model): a rank holds the parameters every rank holds
  (attention, norms, routers, embeddings: ``dense``) and ``experts / ep`` of each block's
  experts (``expert``), both 1/tp where tensor parallelism splits the products. ZeRO shards the
  dense part over the data ranks and the experts' over their expert-data group (dp / ep ranks
  hold the same experts). At zero 0 in fp32 that is ``(4 + 4 + 8) * (dense + experts / ep)``
  bytes, the formula of ``bench/moe/formulas.py``.
- Compute (``compute``): the dense layout counts one MLP's products per token; a token of a
  MoE block runs ``top_k`` experts and the router (``hidden x experts``), so the extra forward
  FLOPs are ``2 x ((top_k - 1) x expert MLP + hidden x experts)`` per token and block (over tp),
  backward twice that, recomputation one forward more; whatever ep, as every token is computed
  once per choice somewhere in the group.
- All-to-alls (``all_to_all``): per MoE layer and micro-batch, the forward dispatches every
  (token, choice) row of this rank, ``tokens x top_k x hidden x bytes``, to the rank holding the
  chosen expert and the combine brings as many back; backward sends both again, reversed
  (``a2a_bytes_per_layer``). The next product waits for them, so they have no overlap window;
  recomputation repeats the forward's.

- Gradients (``expert_grad_sync``): the dense layout's gradient reduction (``timing.dp_comm``)
  covers one MLP per block over the data ranks; the rank's other expert gradients reduce over
  their expert-data group (dp / ep ranks): all-reduced at zero 0, reduce-scattered above.

``time_items`` is what the cost model's time list holds: all three. Not modelled (small beside
the above at the shapes that need ep): the router's row-count exchange (8 bytes per expert),
the uneven load of a badly balanced router (the step waits for the busiest expert's rank), the
expert-data group's parameter all-gathers under ZeRO 1-3 and the optimizer step on the extra
experts.
"""

from __future__ import annotations

from kernels_runtime.mesh.plan import PlanError
from workbench.planner import memory
from workbench.planner.memory import bucket_count
from workbench.planner.parallel_comm import collective_item
from workbench.planner.setting import MemoryItem, Setting, TimeItem


def a2a_bytes_per_layer(tokens: float, top_k: int, hidden: int, elem: int) -> float:
    """Bytes one rank hands to the all-to-alls of one MoE layer in one pass (forward or
    backward): its ``tokens`` rows, each ``top_k`` times, out (dispatch) and back (combine)."""
    return 2 * tokens * top_k * hidden * elem


def local_params(st: Setting) -> tuple[float, float]:
    """(dense, expert) parameters this rank holds before ZeRO: the dense layout's shard less
    its one MLP per block plus the routers, and ``experts / ep`` experts per block, over tp."""
    spec, layers = st.spec, st.layers
    mlp = spec.expert_mlp_params / st.tp
    dense = st.psi_local - layers * mlp + layers * spec.hidden * spec.experts
    expert = layers * spec.experts // st.plan.ep * mlp
    return dense, expert


def model_states(st: Setting) -> list[MemoryItem]:
    """Parameters, gradients and optimizer states of this rank: ``memory.model_states`` for a
    dense model; for a mixture of experts the dense part sharded by ZeRO over the data ranks
    and the rank's experts over their expert-data group (dp / ep ranks)."""
    ep = st.plan.ep
    if not st.spec.experts:
        if ep > 1:
            raise PlanError(f"ep={ep} splits the experts of mixture-of-experts blocks, and this "
                            "model description has none; give experts= and top_k= (an HF "
                            "config's num_local_experts / num_experts_per_tok), or use ep=1")
        return memory.model_states(st)
    dense, expert = local_params(st)
    zero, precision = st.plan.zero_stage, st.plan.precision
    d = memory.runtime_model_state_bytes(dense, st.data_ranks, zero, precision)
    e = memory.runtime_model_state_bytes(expert, st.data_ranks // ep, zero, precision)
    experts = f"{st.spec.experts // ep} of {st.spec.experts} experts per block"
    split = f", 1/{st.tp} of the split weights" if st.tp > 1 else ""
    masters = "fp32 masters, " if precision != "fp32" else ""
    return [MemoryItem("params", d[0] + e[0], note=f"{experts}{split}"),
            MemoryItem("grads", d[1] + e[1]),
            MemoryItem("optimizer", d[2] + e[2], note=f"{masters}Adam moments; {experts}")]


def all_to_all(st: Setting) -> list[TimeItem]:
    """The ep group's dispatch and combine all-to-alls per step (all micro-batches and MoE
    layers of this rank), exposed; none without experts or with ep=1."""
    ep, spec = st.plan.ep, st.spec
    if ep == 1 or not spec.experts:
        return []
    m, layers = st.microbatches, st.layers
    per_layer = a2a_bytes_per_layer(st.tokens_per_micro, spec.top_k, spec.hidden, st.elem)
    stride = st.tp * st.pp  # ep ranks are data-parallel ranks: tp x pp apart

    def a2a(name: str, phase: str) -> TimeItem:
        return collective_item(st, name, ("all_to_all",), layers * m * per_layer, 2 * layers * m,
                           "ep", ep, stride, phase)

    items = [a2a("expert dispatch + combine all-to-alls", "forward"),
             a2a("expert backward all-to-alls", "backward")]
    if st.plan.activation_checkpointing:
        items.append(a2a("expert recomputed all-to-alls", "backward"))
    return items


def compute(st: Setting) -> list[TimeItem]:
    """The products a MoE block adds to the dense layout's one MLP per token: ``top_k - 1``
    more experts and the router; none for a dense model. Named "matmuls" as the products'
    overlap window counts them (``cost_model.exposed_comm``)."""
    spec = st.spec
    if not spec.experts:
        return []
    tokens = st.tokens_per_micro * st.microbatches
    extra = (spec.top_k - 1) * spec.expert_mlp_params + spec.hidden * spec.experts
    flops = 2 * st.layers * extra * tokens / st.tp  # forward
    fwd, bwd = st.hw.forward_flops(st.plan.precision), st.hw.backward_flops(st.plan.precision)
    items = [TimeItem("forward expert matmuls", "compute", flops / fwd, phase="forward",
                      note=f"top-{spec.top_k} experts and the router"),
             TimeItem("backward expert matmuls", "compute", 2 * flops / bwd, phase="backward")]
    if st.plan.activation_checkpointing:
        items.append(TimeItem("recomputed expert matmuls", "compute", flops / fwd,
                              phase="backward"))
    return items


def expert_grad_sync(st: Setting) -> list[TimeItem]:
    """The rank's expert gradients beyond the one MLP per block ``timing.dp_comm`` counts,
    reduced over their expert-data group (dp / ep ranks, tp x pp apart) once the backward
    ends: fp32, all-reduced at zero 0, reduce-scattered above; none in a group of one."""
    edp = st.data_ranks // st.plan.ep
    if not st.spec.experts or edp == 1:
        return []
    extra = local_params(st)[1] - st.layers * st.spec.expert_mlp_params / st.tp
    if extra <= 0:
        return []
    op = "all_reduce" if st.plan.zero_stage == 0 else "reduce_scatter"
    window = "backward_last" if st.pp == 1 else None
    return [collective_item(st, f"expert gradient {op.replace('_', '-')}", (op,), extra * 4.0,
                        bucket_count(extra), "dp", edp, st.tp * st.pp, "backward", window)]


def time_items(st: Setting) -> list[TimeItem]:
    """The cost model's time term for experts: their extra compute, the all-to-alls and the
    expert gradients' reduction."""
    return compute(st) + all_to_all(st) + expert_grad_sync(st)
