"""Communication inside the layers: 1D tensor parallelism and sequence parallelism.

1D tensor parallelism (Megatron; REFERENCES.md): per layer and micro-batch, 2 all-reduces of
this rank's ``b*s*h`` activations in forward (after attention's and the MLP's row-parallel
products) and 2 in backward (before the column-parallel ones); full recomputation reruns the
forward and its 2. Megatron sequence parallelism (sp_mode=split_gather, Korthikanti et al.
2022) replaces each all-reduce by an all-gather before a column product and a reduce-scatter
after a row product: the same ring volume and latency count, priced per op. Outside the layers
the vocab-parallel embedding's output and the head's input gradient cost one all-reduce's worth
each, and the loss either all-reduces three ``(b, s)`` fp32 statistics (a vocabulary-parallel
cross-entropy) or all-gathers the ``(b, s, V)`` logits (an HF model's gathered output, which is
what a trial's loss reads). These collectives sit between a layer's products, so nothing hides
them: they are exposed (no overlap window). Under split_gather the block's replicated
parameters (norms, row biases) see only this rank's tokens, so backward all-reduces each one's
gradient over tp (``PartialGradModule``): small, but one collective's latency per tensor.

Ulysses (sp_mode=all_to_all, arXiv 2309.14509): per attention layer forward 4 all-to-alls of
this rank's ``(b, s/sp, width/tp)`` q, k, v (before attention) and output (after), 4 in
backward, 4 more under recomputation; attention waits for them, so they are exposed. Ring
attention (sp_mode=ring, arXiv 2310.01889): per layer forward sp-1 steps each passing this
rank's K and V blocks to the next rank; backward passes K/V around again (sp-1 steps) and the
dK/dV blocks all the way back to their owner (sp steps); recomputation adds a forward's sp-1.
Each step overlaps the blockwise attention of the block in hand, so ring transfers hide behind
attention compute (windows ``forward_attention`` / ``backward_attention``, see ``cost_model``).
For an HF model this runtime joins the sequence after the final norm (one all-gather of the
``(b, s, h)`` hidden states over sp, exposed), so the head and the loss see every token.
"""

from __future__ import annotations

from workbench.planner.activations import profile_for
from workbench.planner.setting import Setting, TimeItem
from workbench.planner.timing import p2p_seconds, ring_seconds


def collective_item(st: Setting, name: str, ops: tuple[str, ...], nbytes: float, count: int,
                    axis: str, ranks: int, stride: int, phase: str,
                    window: str | None = None) -> TimeItem:
    """``count`` collectives (each one of every op in ``ops``) moving ``nbytes`` in all: the
    time item every axis's communication term is made of (tp, sp here; ep in
    ``expert_terms.py``)."""
    seconds = 0.0
    for op in ops:
        link = st.hw.link(op, ranks, stride)
        seconds += ring_seconds(op, nbytes, ranks, link.bandwidth, link.latency, count)
    return TimeItem(name, "comm", seconds, phase=phase, window=window, axis=axis,
                    count=count * len(ops), nbytes=nbytes * len(ops), note=" + ".join(ops))


def tp_comm(st: Setting) -> list[TimeItem]:
    """The tp group's collectives per step (all micro-batches), exposed. A 2D / 2.5D grid's
    are ``grid_comm``'s."""
    t = st.tp
    if t == 1 or st.grid is not None:
        return []
    m, layers = st.microbatches, st.layers
    activation = st.tokens_per_micro * st.spec.hidden * st.elem  # (b, s/sp, h) bytes
    ops = ("all_gather", "reduce_scatter") if st.sequence_parallel else ("all_reduce",)
    what = "all-gathers + reduce-scatters" if st.sequence_parallel else "all-reduces"
    # the layers' 2 each, the embedding's output in forward, the head's input gradient in
    # backward (on a pipeline: on the first and the last stage)
    forward = 2 * layers * m + (m if st.has_embedding else 0)
    backward = 2 * layers * m + (m if st.has_head else 0)

    def item(name: str, count: int, phase: str) -> TimeItem:
        return collective_item(st, name, ops, count * activation, count, "tp", t, 1, phase)

    items = [item(f"tp forward {what}", forward, "forward"),
             item(f"tp backward {what}", backward, "backward")]
    if st.plan.activation_checkpointing:
        items.append(item(f"tp recomputed {what}", 2 * layers * m, "backward"))
    if st.sequence_parallel:
        tensors = st.spec.layer_replicated_tensors * layers * m
        whole = (st.spec.layer_params - st.spec.layer_split_params) * layers * m * st.elem
        items.append(collective_item(st, "tp replicated-parameter gradient all-reduces",
                                 ("all_reduce",), whole, tensors, "tp", t, 1, "backward"))
    if not st.has_head:
        return items
    if profile_for(st.spec).vocab_parallel_loss:
        stats = 3 * m
        items.append(collective_item(st, "tp loss statistics all-reduces", ("all_reduce",),
                                 stats * st.tokens_per_micro * 4, stats, "tp", t, 1,
                                 "forward"))
    else:
        logits = st.micro_batch * st.spec.seq * st.spec.vocab * st.elem  # sequence joined
        items.append(collective_item(st, "tp logits all-gather", ("all_gather",), m * logits, m,
                                 "tp", t, 1, "forward"))
    return items


def sp_comm(st: Setting) -> list[TimeItem]:
    """The sp group's attention traffic per step: Ulysses all-to-alls or ring K/V steps."""
    sp = st.sp
    if sp == 1:
        return []
    m, layers, spec = st.microbatches, st.layers, st.spec
    recompute = st.plan.activation_checkpointing
    items = []
    if not profile_for(spec).sp_head_split:  # the sequence joined before the head
        whole = m * st.micro_batch * spec.seq * spec.hidden * st.elem
        items.append(collective_item(st, "sequence join all-gather", ("all_gather",), whole, m,
                                 "sp", sp, st.tp, "forward"))
    if st.plan.sp_mode == "all_to_all":
        width = (2 * spec.hidden + 2 * spec.kv_size) / st.tp  # q, out + k, v of this rank
        per_layer = st.tokens_per_micro * width * st.elem  # the 4 tensors' bytes
        count = 4 * layers * m

        def a2a(name: str, phase: str) -> TimeItem:
            return collective_item(st, name, ("all_to_all",), layers * m * per_layer, count, "sp",
                               sp, st.tp, phase)

        items += [a2a("Ulysses forward all-to-alls", "forward"),
                  a2a("Ulysses backward all-to-alls", "backward")]
        if recompute:
            items.append(a2a("Ulysses recomputed all-to-alls", "backward"))
        return items
    block = st.tokens_per_micro * 2 * spec.kv_size / st.tp * st.elem  # this rank's K and V
    link = st.hw.link("p2p", sp, st.tp)

    def ring(name: str, steps: int, phase: str) -> TimeItem:
        count = steps * layers * m
        seconds = p2p_seconds(count * block, link.bandwidth, link.latency, count)
        return TimeItem(name, "comm", seconds, phase=phase, window=f"{phase}_attention",
                        axis="sp", count=count, nbytes=count * block, note="p2p")

    items += [ring("ring attention forward K/V", sp - 1, "forward"),
              ring("ring attention backward K/V + dK/dV", 2 * sp - 1, "backward")]
    if recompute:
        items.append(ring("ring attention recomputed K/V", sp - 1, "backward"))
    return items
