"""Time terms of one optimizer step: matmuls, memory-bound work, optimizer, communication,
fixed overheads. How much communication hides behind compute is decided in ``cost_model``.

Compute follows the usual count (Kaplan et al.; Narayanan et al. 2021): a token costs 2 FLOPs
per weight of a matrix product forward and 4 backward (the "6 Psi"), plus ``4*s*h`` per layer
forward for the two attention products (``12*L*h*s`` over the three passes). Full recomputation
runs every layer's forward once more (x4/3 on the layers; the output head is not recomputed).
Embedding lookups cost no FLOPs, so Psi here counts matrix weights only, the output projection
included. Forward and backward divide by their own measured rates, because they differ on some
hardware (bf16 on a CPU without bf16 instructions: ~10x).

Communication is ring collectives (REFERENCES.md): an all-reduce takes ``2(P-1)/P * bytes / bw +
2(P-1) * latency``, a reduce-scatter, an all-gather or an all-to-all half the bandwidth and
latency terms. A broadcast (or reduce) pipelines its tensor in chunks along a chain of the P
ranks: every rank but the root receives (sends) all of it, ``bytes / bw + (P-1) * latency``.
This module prices the data-parallel axis: this runtime reduces gradients in fp32 whatever the
precision and gathers parameters in the compute dtype. Tensor- and sequence-parallel traffic is
in ``parallel_comm``, a 2D / 2.5D grid's in ``grid_comm``.
"""

from __future__ import annotations

from workbench.planner.activations import activation_bytes, profile_for
from workbench.planner.memory import bucket_count
from workbench.planner.setting import Setting, TimeItem


def ring_seconds(op: str, nbytes: float, ranks: int, bandwidth: float, latency: float,
                 count: int = 1) -> float:
    """Time of ``count`` ring collectives moving ``nbytes`` in all (the unsharded size; for an
    all-to-all, the local tensors' size: each rank keeps 1/P of its own and sends the rest)."""
    if ranks <= 1:
        return 0.0
    if op in ("broadcast", "reduce"):
        return nbytes / bandwidth + (ranks - 1) * latency * count
    steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
    return steps / ranks * nbytes / bandwidth + steps * latency * count


def p2p_seconds(nbytes: float, bandwidth: float, latency: float, count: int = 1) -> float:
    """Time of ``count`` point-to-point sends to a neighbour moving ``nbytes`` in all."""
    return nbytes / bandwidth + latency * count


def compute(st: Setting) -> list[TimeItem]:
    """Forward FLOPs per token: 2 per matrix weight of the layers and the output head, and
    4*s*h per layer for attention; backward twice that; recomputation one more layer forward.
    Tensor parallelism, 1D or on a grid, divides every product (and attention's heads, on a
    grid also the samples) by tp; a rank of the sp axis computes its s/sp tokens (against all
    s keys, by ring steps or whole heads). A pipeline stage computes its own blocks, and the
    head only on the last stage."""
    spec, precision, t = st.spec, st.plan.precision, st.tp
    tokens = st.tokens_per_micro * st.microbatches
    layers = st.layers * 2 * spec.layer_matmul_params * tokens / t
    # this runtime joins the sequence before the head: every sp rank computes all its logits
    joined = st.sp > 1 and not profile_for(spec).sp_head_split
    head = 2 * spec.vocab * spec.hidden * tokens * (st.sp if joined else 1) / t \
        if st.has_head else 0.0
    attention = st.layers * 4 * spec.seq * spec.hidden * tokens / t
    fwd, bwd = st.hw.forward_flops(precision), st.hw.backward_flops(precision)
    att_fwd, att_bwd = st.hw.attention_rates(precision)
    items = [
        TimeItem("forward matmuls", "compute", (layers + head) / fwd, phase="forward"),
        TimeItem("forward attention", "compute", attention / att_fwd, phase="forward"),
        TimeItem("backward matmuls", "compute", 2 * (layers + head) / bwd, phase="backward"),
        TimeItem("backward attention", "compute", 2 * attention / att_bwd, phase="backward"),
    ]
    if st.plan.activation_checkpointing:
        items += [TimeItem("recomputation", "compute", layers / fwd, phase="backward",
                           note="one more forward of every layer's products"),
                  TimeItem("recomputed attention", "compute", attention / att_fwd,
                           phase="backward")]
    return items


def elementwise(st: Setting) -> list[TimeItem]:
    """Memory-bound ops (norms, activation functions, residual adds, copies, fresh memory),
    proportional to the bytes kept for backward without recomputation, at the rate measured
    for blocks of this micro-batch's size (``HardwareProfile.activation_rate_at``)."""
    kept = activation_bytes(st.spec, st.micro_batch, st.elem, False, st.tp, st.sp,
                            st.plan.sp_mode, st.grid, layers=st.layers)
    if not st.has_head:
        kept["head"] = 0.0
    # the rate at this micro-batch's working set: one layer's kept bytes (a calibration
    # block's measure); on a CPU it moves with the size, differently per precision
    per_layer = kept["layers"] / st.layers if st.layers else kept["head"]
    rate = st.hw.activation_rate_at(st.plan.precision, per_layer)
    seconds = (kept["layers"] + kept["head"]) * st.microbatches / rate
    items = [TimeItem("forward memory-bound ops", "compute", seconds / 3, phase="forward"),
             TimeItem("backward memory-bound ops", "compute", 2 * seconds / 3, phase="backward")]
    if st.plan.activation_checkpointing and seconds:
        share = kept["layers"] / (kept["layers"] + kept["head"])
        items.append(TimeItem("recomputed memory-bound ops", "compute", share * seconds / 3,
                              phase="backward"))
    return items


def optimizer(st: Setting) -> list[TimeItem]:
    """AdamW on this rank's fp32 masters, plus casts between 16-bit and fp32 copies and
    zeroing the gradient buffers (all of this rank's tensor-parallel shard)."""
    stage, n, e, psi = st.plan.zero_stage, st.data_ranks, st.elem, st.psi_local
    elems = psi if stage == 0 else psi / n
    casts = (2 * e + 8) * elems if e != 4 else 0.0
    zeroing = {0: psi * e, 1: psi * e, 2: psi * e / n}.get(stage, 0.0)
    return [TimeItem("optimizer step", "optimizer", elems / st.hw.adam_rate
                     + (casts + zeroing) / st.hw.elementwise_bandwidth["fp32"])]


def dp_comm(st: Setting) -> list[TimeItem]:
    """Gradient reduction and parameter gathering of ZeRO stage 0-3 over the data ranks.

    Stages 0/1 communicate gradients once per step (earlier micro-batches accumulate locally),
    behind the last micro-batch's backward; stage 2 reduce-scatters after every micro-batch;
    stages 1/2 all-gather the updated parameters after the step, exposed; stage 3 all-gathers
    each block's parameters before its forward and again before its backward, every
    micro-batch, and reduces gradients once (1.5x the traffic of an all-reduce). Each rank
    moves its tensor-parallel shard. Under sequence parallelism on the sp axis the data ranks
    are dp x sp (their replicas hold the same parameters): one ring over them. Under a pipeline
    (zero 0 or 1) each stage reduces its own parameters once every backward of the step is
    done, so nothing hides the reduction (no window).
    """
    n, stage, m = st.data_ranks, st.plan.zero_stage, st.microbatches
    if n == 1:
        return []
    stride = st.plan.tp * st.plan.pp  # dp ranks lie tp x pp apart (sp replicas: tp apart)
    last = "backward_last" if st.pp == 1 else None
    axis = "dp_sp" if st.sp > 1 else "dp"
    grads, params = st.psi_local * 4.0, st.psi_local * float(st.elem)
    buckets = bucket_count(st.psi_local) if stage < 3 else st.spec.layers + 1

    def item(name: str, op: str, nbytes: float, times: int, window: str | None) -> TimeItem:
        link = st.hw.link(op, n, stride)
        seconds = times * ring_seconds(op, nbytes, n, link.bandwidth, link.latency, buckets)
        return TimeItem(name, "comm", seconds, window=window, axis=axis, count=times * buckets,
                        nbytes=times * nbytes, note=op)

    if stage == 0:
        return [item("gradient all-reduce", "all_reduce", grads, 1, last)]
    if stage == 1:
        return [item("gradient reduce-scatter", "reduce_scatter", grads, 1, last),
                item("parameter all-gather", "all_gather", params, 1, None)]
    if stage == 2:
        return [item("gradient reduce-scatter", "reduce_scatter", grads, m, "backward"),
                item("parameter all-gather", "all_gather", params, 1, None)]
    return [item("forward parameter all-gather", "all_gather", params, m, "forward"),
            item("backward parameter all-gather", "all_gather", params, m, "backward"),
            item("gradient reduce-scatter", "reduce_scatter", grads, 1, "backward_last")]


def overhead(st: Setting) -> list[TimeItem]:
    """Per step, per micro-batch (per model chunk of a pipeline rank: each is a forward of
    its own) and per layer and micro-batch."""
    ov = st.hw.overhead_for(st.plan.zero_stage)
    return [TimeItem("fixed overhead", "overhead",
                     ov.step + micro_overhead(st),
                     note="per step + per micro-batch + per layer and micro-batch")]


def micro_overhead(st: Setting) -> float:
    """The part of ``overhead`` spent inside forwards and backwards (a pipeline's actions)."""
    ov = st.hw.overhead_for(st.plan.zero_stage)
    return st.microbatches * (ov.micro * len(st.virtual_stages) + st.layers * ov.layer)
