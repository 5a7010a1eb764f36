"""Expert parallelism's cost terms: the experts' model state divided over ep, and the all-to-alls.

Why a file of its own: a mixture-of-experts block keeps ``experts`` MLPs where a dense block
keeps one, and an ep group of ranks (carved out of the data-parallel ranks, as Megatron's and
ColossalAI's expert parallelism; ``kernels_runtime.parallel.expert``) splits them, so a plan's
memory and communication change in two places only, both here:

- Model state (``model_states``, which replaces ``memory.model_states`` in the cost model's
  list and returns it unchanged for a dense model): a rank holds the parameters every rank holds
  (attention, norms, routers, embeddings: ``dense``) and ``experts / ep`` of each block's
  experts (``expert``), 1/tp where tensor parallelism splits the products; the experts only
  under ep > 1: at ep=1 the runtime's tensor policy leaves them whole on every tp rank
  (``policies/moe.py``: replicated over tp, as the router always is). ZeRO shards the
  dense part over the data ranks and the experts' over their expert-data group (dp / ep ranks
  hold the same experts). At zero 0 in fp32 that is ``(4 + 4 + 8) * (dense + experts / ep)``
  bytes, the formula of ``bench/moe/formulas.py``.
- Compute (``compute``): the dense layout counts one MLP's products per token; a token of a
  MoE block runs ``top_k`` experts and the router (``hidden x experts``), so the extra forward
  FLOPs are ``2 x ((top_k - 1) x expert MLP + hidden x experts)`` per token and block (the
  experts over tp under ep > 1; at ep=1 each tp rank runs them whole), backward twice that,
  recomputation one forward more; whatever ep, as every token is computed once per choice
  somewhere in the group.
- All-to-alls (``all_to_all``): per MoE layer and micro-batch, the forward dispatches every
  (token, choice) row of this rank, ``tokens x top_k x hidden x bytes``, to the rank holding the
  chosen expert and the combine brings as many back; backward sends both again, reversed
  (``a2a_bytes_per_layer``). The next product waits for them, so they have no overlap window;
  recomputation repeats the forward's.

- Gradients (``expert_grad_sync``): the dense layout's gradient reduction (``timing.dp_comm``)
  covers one MLP per block over the data ranks; the rank's other expert gradients reduce over
  their expert-data group (dp / ep ranks): all-reduced at zero 0, reduce-scattered above.

- Parameter all-gathers (``expert_param_gathers``): ZeRO 1-2 gather the updated expert shards
  over the expert-data group after the step, ZeRO-3 before every forward and backward of a
  micro-batch (FSDP2 gathers a block's experts as one unit: all ``experts`` without ep,
  ``experts / ep`` under ep); ``timing.dp_comm`` counts one MLP per block.
- Activations (``activations``, beside ``memory.activations``): a token's ``top_k`` expert
  rows each keep their input, their MLP's values and their weighted output, where the dense
  layout counts one MLP.
- Buffers (``buffers``, which replaces ``memory.buffers``): the same gathered blocks under
  ZeRO-3 hold this rank's experts of the block, and below it the fp32 gradient copy and the
  reduce-scatter output cover the experts too. This is where ep saves memory beside ZeRO-3,
  which shards the model state the same whatever ep (experts / ep over dp / ep ranks).

``time_items`` is what the cost model's time list holds: all four. Not modelled (small beside
the above at the shapes that need ep): the router's row-count exchange (8 bytes per expert),
the uneven load of a badly balanced router (the step waits for the busiest expert's rank) and
the optimizer step on the extra experts. ``check`` refuses what the runtime's expert applier
refuses of a workload's shape (tp not dividing the experts' intermediate size).
"""

from __future__ import annotations

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner import memory
from workbench.planner.activations import mlp_values
from workbench.planner.memory import bucket_count
from workbench.planner.parallel_comm import collective_item
from workbench.planner.setting import MemoryItem, Setting, TimeItem
from workbench.planner.spec import ModelSpec


def a2a_bytes_per_layer(tokens: float, top_k: int, hidden: int, elem: int) -> float:
    """Bytes one rank hands to the all-to-alls of one MoE layer in one pass (forward or
    backward): its ``tokens`` rows, each ``top_k`` times, out (dispatch) and back (combine)."""
    return 2 * tokens * top_k * hidden * elem


def local_params(st: Setting) -> tuple[float, float]:
    """(dense, expert) parameters this rank holds before ZeRO: the dense layout's shard less
    its one MLP per block (1/tp there) plus the routers (whole), and ``experts / ep`` experts
    per block, 1/tp under ep > 1 and whole at ep=1 (``expert_tp``)."""
    spec, layers = st.spec, st.layers
    dense = st.psi_local - layers * spec.expert_mlp_params / st.tp \
        + layers * spec.hidden * spec.experts
    expert = layers * spec.experts // st.plan.ep * spec.expert_mlp_params / expert_tp(st)
    return dense, expert


def expert_tp(st: Setting) -> int:
    """What tp divides an expert by: tp under ep > 1 (the expert applier splits each expert
    over tp), 1 at ep=1 (the tensor policy replicates the experts over tp)."""
    return st.tp if st.plan.ep > 1 else 1


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
    """The products a MoE block adds to the dense layout's one MLP per token (1/tp there):
    ``top_k`` experts (1/tp under ep > 1, whole at ep=1: ``expert_tp``) instead, and the
    router (replicated over tp); none for a dense model. Named "matmuls" as the products'
    overlap window counts them (``cost_model.exposed_comm``)."""
    spec = st.spec
    if not spec.experts:
        return []
    tokens = st.tokens_per_micro * st.microbatches
    mlp = spec.expert_mlp_params
    extra = spec.top_k * mlp / expert_tp(st) - mlp / st.tp + spec.hidden * spec.experts
    flops = 2 * st.layers * extra * tokens  # forward, per rank
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


def expert_param_gathers(st: Setting) -> list[TimeItem]:
    """The rank's expert parameters beyond ``timing.dp_comm``'s one MLP per block, all-gathered
    in the compute dtype over their expert-data group: after the step under ZeRO 1-2, before
    every micro-batch's forward and backward under ZeRO-3; none at zero 0 or in a group of
    one."""
    edp, zero = st.data_ranks // st.plan.ep, st.plan.zero_stage
    if not st.spec.experts or edp == 1 or zero == 0:
        return []
    extra = local_params(st)[1] - st.layers * st.spec.expert_mlp_params / st.tp
    if extra <= 0:
        return []
    nbytes, stride = extra * st.elem, st.tp * st.pp

    def gather(name: str, times: int, phase: str, window: str | None) -> TimeItem:
        return collective_item(st, name, ("all_gather",), times * nbytes, times * st.layers,
                               "dp", edp, stride, phase, window)

    if zero < 3:
        return [gather("expert parameter all-gather", 1, "step", None)]
    m = st.microbatches
    return [gather("expert forward parameter all-gather", m, "forward", "forward"),
            gather("expert backward parameter all-gather", m, "backward", "backward")]


def buffers(st: Setting) -> list[MemoryItem]:
    """``memory.buffers`` (the dense layout: one MLP per block) plus the experts' share: under
    ZeRO-3 the two gathered blocks' other experts and routers (in the compute dtype, their
    unsharded gradients in fp32); below it the fp32 gradient copy and the reduce-scatter
    output of the rank's experts and routers."""
    items = memory.buffers(st)
    if not st.spec.experts:
        return items
    dense, expert = local_params(st)
    extra = dense + expert - st.psi_local  # this rank's parameters beyond the dense layout
    zero, e, n = st.plan.zero_stage, st.elem, st.data_ranks
    if zero == 3:
        block = extra / st.layers
        more = 2 * block * e + 2 * block * 4
    else:
        more = extra * 4 if (e != 4 or zero == 2) else 0.0
        if zero:
            more += (dense * 4 / n + expert * 4 / (n // st.plan.ep)) - st.psi_local * 4 / n
    held = f"{st.spec.experts // st.plan.ep} of {st.spec.experts} experts per block"
    return [*items, MemoryItem("buffers", more, note=f"the experts' share ({held})")]


def activations(st: Setting) -> list[MemoryItem]:
    """What a MoE block keeps for backward beyond the dense layout's one MLP per token
    (``memory.activations``): each of a token's ``top_k`` rows keeps its gathered input, its
    expert's MLP values (1/tp under ep > 1, whole at ep=1: ``expert_tp``) and its weighted
    output (``2 x hidden`` + the MLP's values), and the router its logits and probabilities;
    per layer, or for the one layer recomputed under checkpointing. Measured on transformers'
    Mixtral (eager loop over experts) and the runtime's ``ExpertParallelMoE`` alike (the ep
    trial of ``tests/workbench/tuner/test_tuner_expert.py``). Under pp:
    ``pipeline.activations``, which counts the dense layout."""
    spec = st.spec
    if not spec.experts or st.pp > 1:
        return []
    h, f, mlp = spec.hidden, spec.ffn_size, mlp_values(spec.activation)
    values = spec.top_k * (2 * h + mlp * f / expert_tp(st)) - mlp * f / st.tp \
        + 2 * spec.experts
    layers = 1 if st.plan.activation_checkpointing else st.layers
    return [MemoryItem("activations", layers * values * st.tokens_per_micro * st.elem,
                       note=f"top-{spec.top_k} expert rows and the router")]


def check(plan: Plan, spec: ModelSpec) -> None:
    """What the expert applier refuses of the shape: under ep each expert is split over tp
    (gate/up by output, down by input), so tp must divide the intermediate size."""
    if plan.ep > 1 and spec.experts and spec.ffn_size % plan.tp:
        fits = [t for t in range(1, spec.ffn_size + 1) if spec.ffn_size % t == 0][:8]
        raise PlanError(f"tp={plan.tp} does not divide the experts' intermediate size "
                        f"{spec.ffn_size}: under ep={plan.ep} each expert is split over tp; "
                        f"choose tp in {fits}")


def time_items(st: Setting) -> list[TimeItem]:
    """The cost model's time term for experts: their extra compute, the all-to-alls, the
    expert gradients' reduction and the expert parameters' all-gathers."""
    return compute(st) + all_to_all(st) + expert_grad_sync(st) + expert_param_gathers(st)
