"""Memory terms: model states under ZeRO, activations, and transient communication buffers.

Model states are counted the way ``BoostedOptimizer.memory_breakdown()`` measures them, which is
the ZeRO paper's accounting (Rajbhandari et al. 2019): fp32 master copies are optimizer state.
In bf16/fp16, stages 0-2 keep 16-bit parameters (2 bytes) and 16-bit gradients (2) beside fp32
masters and Adam moments (12); in fp32 the parameters are the masters (4 + 4 + 8). Stage 3 runs
on FSDP2, which stores fp32 parameter and gradient shards that double as the masters: 4/N +
4/N + 8/N, the paper's 16/N total split differently (``paper_model_state_bytes`` gives the
paper's split, used for projections and checked against its 7.5B example).

Under 1D tensor parallelism every count is of this rank's shard (``ModelSpec.params_per_rank``:
products and column biases / tp, the vocabulary padded to a multiple of tp and split, norms,
row biases and positions whole), and ZeRO shards that over the data ranks: dp, times sp under
sequence parallelism on the sp axis (its ranks hold the same parameters, and the runtime folds
them into the data axis). On a 2D / 2.5D grid a rank holds block (i, j) of every matrix (1/q^2)
and chunk j of every vector (1/q), the same block on every depth (``ModelSpec.grid_*``): the
table's parameter memory 1/q^2 whatever d; ZeRO shards that over dp.
"""

from __future__ import annotations

import math

from workbench.planner.activations import activation_bytes
from workbench.planner.setting import MemoryItem, Setting

BUCKET_BYTES = 8 * 2**20  # ZeroOptimizer's default bucket: 8 MiB of fp32 parameters


def paper_model_state_bytes(psi: float, n: int, stage: int,
                            precision: str = "bf16") -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes per rank in the ZeRO paper's table:
    mixed precision 2 + 2 + K (K = 12) bytes per parameter, fp32 4 + 4 + 8; stage 1 shards the
    optimizer states, stage 2 also gradients, stage 3 also parameters, over ``n`` ranks."""
    p, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    return (psi * p / (n if stage >= 3 else 1), psi * g / (n if stage >= 2 else 1),
            psi * k / (n if stage >= 1 else 1))


def runtime_model_state_bytes(psi: float, n: int, stage: int,
                              precision: str) -> tuple[float, float, float]:
    """The same, as this runtime stores them (see the module docstring for stage 3)."""
    if stage == 3:
        return psi * 4 / n, psi * 4 / n, psi * 8 / n
    return paper_model_state_bytes(psi, n, stage, precision)


def model_states(st: Setting) -> list[MemoryItem]:
    """ZeRO shards this rank's tensor-parallel shard over the data ranks (dp x sp): tp
    divides the split weights (products, column biases, the vocabulary), norms and row biases
    stay whole."""
    params, grads, opt = runtime_model_state_bytes(st.psi_local, st.data_ranks,
                                                   st.plan.zero_stage, st.plan.precision)
    masters = "fp32 masters, " if st.plan.precision != "fp32" else ""
    split = f"; 1/{st.tp} of the split weights" if st.tp > 1 else ""
    if st.grid is not None:
        split = f"; 1/{st.grid[0] ** 2} of the matrices (grid block), 1/{st.grid[0]} of vectors"
    return [MemoryItem("params", params, note=split.removeprefix("; ")),
            MemoryItem("grads", grads), MemoryItem("optimizer", opt,
                                                   note=f"{masters}Adam moments{split}")]


def activations(st: Setting) -> list[MemoryItem]:
    """One micro-batch in flight (micro-batches run one after another). A pipeline stage keeps
    several: ``pipeline.activations``."""
    if st.pp > 1:
        return []
    act = activation_bytes(st.spec, st.micro_batch, st.elem, st.plan.activation_checkpointing,
                           st.tp, st.sp, st.plan.sp_mode, st.grid)
    how = "layer inputs + one layer recomputed" if st.plan.activation_checkpointing else \
        "all layers"
    return [MemoryItem("activations", act["layers"], note=how),
            MemoryItem("activations", act["head"], note="embedding ids, norm, logits")]


def buffers(st: Setting) -> list[MemoryItem]:
    """Transient buffers at the end of backward (estimates, not measured by the benchmark):
    fp32 copies of 16-bit gradients for the reduction, reduce-scatter outputs, and under ZeRO-3
    the gathered parameters and unsharded gradients of two blocks plus the root's parameters
    (all of this rank's tensor-parallel shard); on a grid also the SUMMA blocks in flight."""
    psi, n, stage, e = st.psi_local, st.data_ranks, st.plan.zero_stage, st.elem
    grid = [MemoryItem("buffers", summa_buffer_bytes(st), note="SUMMA blocks in flight")] \
        if st.grid is not None else []
    if stage == 3:
        layer, root = st.layer_params_local, st.embedding_params_local
        return [MemoryItem("buffers", (2 * layer + root) * e + 2 * layer * 4,
                           note="gathered blocks"), *grid]
    fp32_copy = psi * 4 if (e != 4 or stage == 2) else 0.0
    shard = psi * 4 / n if stage else 0.0
    return [MemoryItem("buffers", fp32_copy + shard, note="gradient reduction"), *grid]


def summa_buffer_bytes(st: Setting) -> float:
    """The largest product's transient blocks (``grid_comms``): two activation and two weight
    blocks double-buffered, and backward's q stacked partials of dX and dW (the inputs of its
    two reduce-scatters). An estimate, like the other buffers."""
    assert st.grid is not None
    q, d = st.grid
    n = st.micro_batch * st.spec.seq / (d * q)  # tokens per rank
    return st.elem * max(2 * n * m / q + 2 * m * o / q**2 + n * m + m * o / q
                         for m, o in st.spec.layer_products)


def bucket_count(psi: float) -> int:
    """Collectives per reduction under ZeRO 0-2 (one per flat bucket)."""
    return max(1, math.ceil(psi * 4 / BUCKET_BYTES))
