"""2D (Optimus, SUMMA) and 2.5D (Tesseract) tensor parallelism: the grid's shapes, what it asks
of a workload, and the bytes its SUMMA products move per layer.

Layout (the runtime's ``kernels_runtime/parallel/tensor/grid/``): tp = d*q*q ranks form d
stacked q x q grids (2D: d = 1), tp index k*q*q + i*q + j for depth k, row i, column j, so a row
(``tp_row``) is q consecutive ranks, a column (``tp_col``) q ranks q apart and a depth line
(``tp_dep``) d ranks q*q apart. Activations (b, s, h) lie on rank (k, i, j) as (b/(d*q), s, h/q):
the micro-batch split over depth x rows, the hidden size over columns; every matrix (in, out) is
cut q x q, block (i, j) the same on every depth (parameter memory 1/q^2); vectors (biases, norm
weights) are chunk j.

SUMMA (van de Geijn and Watts 1997; Xu et al., arXiv 2104.05343; Wang et al., arXiv 2105.14500):
a product Y = X W takes q steps; at step l the activation block X[k,i,l] (n*m/q values, with
n = b*s/(d*q) tokens per rank and m input features) is broadcast along the row and the weight
block W[l,j] (m*o/q^2, o output features) along the column. Backward re-broadcasts both (only a
rank's own blocks are saved) and reduces the partials: dX along the row, dW along the column,
each as one reduce-scatter of the q stacked partial blocks; 2.5D then sums dW over the depth.
Each rank is the root of one broadcast in q and keeps one block of a reduce-scatter, so per
product it receives (or sends) q - 1 blocks of each kind, with e bytes per element:

    forward   (q-1) * e * (n*m/q + m*o/q^2)            backward  2 x forward

Summed over a layer's products (``ModelSpec.layer_products``), with n = b*s/(d*q):

    forward bytes per rank per layer = (q-1) * e * (b*s*sum(m)/(d*q^2) + Psi_products/q^2)

a GPT layer (fused QKV, ffn 4h: sum(m) = 7h, Psi_products = 12h^2): (q-1)*e*(7*b*s*h/d +
12*h^2)/q^2 forward, twice that backward, plus 2(d-1)/d * e * 12h^2/q^2 for dW over the depth.
The runtime's telemetry counts payload handed to each op instead, q/(q-1) times this:
3*n*m*e + 3*m*o*e/q per product (``Linear2D``'s docstring). Cross-check with REFERENCES.md's
table (``TABLE``): per SUMMA step of a square product, in units of one activation block of a
2D grid with b*s = h, these bytes are 3(q-1)(d+1)/(d*q) (2D: 6(q-1)/q), exactly the table's
bandwidth term (``summa_step_terms``); the latency is (4 + 2/q)(q-1) link steps per SUMMA step,
below the table's 6(q-1) because each backward reduce is one reduce-scatter, not q reduces.
"""

from __future__ import annotations

import math

from kernels_runtime.mesh.plan import PlanError
from workbench.planner.setting import Setting

# REFERENCES.md, "Tensor parallelism" (ColossalAI's docs), forward + backward, ring collectives:
# scheme -> (bandwidth, latency) as functions of (P, q, d); 1D per all-reduce, 2D / 2.5D per
# SUMMA step, in units of one block.
TABLE = {
    "1d": (lambda p, q, d: 2 * (p - 1) / p, lambda p, q, d: 2 * (p - 1)),
    "2d": (lambda p, q, d: 6 * (q - 1) / q, lambda p, q, d: 6 * (q - 1)),
    "2.5d": (lambda p, q, d: 3 * (q - 1) * (d + 1) / (d * q), lambda p, q, d: 6 * (q - 1)),
}


def grid_shapes(tp: int) -> list[tuple[str, int]]:
    """(tp_mode, tp_depth) of every grid of ``tp`` ranks ``Plan.validate`` accepts: tp = q*q
    (2d) or q*q*d with d >= 2 (2.5d), q >= 2 (2.5d with d = 1 would repeat 2d)."""
    out = []
    for d in range(1, tp + 1):
        if tp % d:
            continue
        q = math.isqrt(tp // d)
        if q >= 2 and q * q * d == tp:
            out.append(("2d", 1) if d == 1 else ("2.5d", d))
    return out


def table_terms(tp_mode: str, tp: int, depth: int = 1) -> tuple[float, float]:
    """The table's (bandwidth, latency) terms for ``tp`` ranks."""
    q = math.isqrt(tp // depth)
    bandwidth, latency = TABLE[tp_mode]
    return bandwidth(tp, q, depth), latency(tp, q, depth)


def summa_wire_bytes(tokens: float, products: list[tuple[int, int]], q: int,
                     elem: float) -> tuple[float, float]:
    """(forward, backward) bytes one rank receives or sends for the SUMMA products
    ``products`` ((in, out) features each) with ``tokens`` tokens per rank (n = b*s/(d*q));
    the depth sum of dW (2(d-1)/d of each dW block, 2.5D) is not included."""
    per_step = sum(tokens * m / q + m * o / q**2 for m, o in products)
    forward = (q - 1) * elem * per_step
    return forward, 2 * forward


def summa_step_terms(q: int, d: int) -> tuple[float, float]:
    """(bandwidth, latency) of one SUMMA step of a square product, derived from the runtime's
    collectives, in the table's units: bytes per rank over one activation block of a 2D grid
    with b*s = h (so a weight block is that size too), and link steps."""
    h = float(q * q * d)  # any size: the ratio does not depend on it
    tokens = h / (d * q)  # b*s = h tokens over d*q row blocks
    forward, backward = summa_wire_bytes(tokens, [(int(h), int(h))], q, 1.0)
    block = h * h / q**2
    hops_per_product = 4 * q * (q - 1) + 2 * (q - 1)  # 4q broadcasts, 2 reduce-scatters
    return (forward + backward) / q / block, hops_per_product / q


def tokens_per_rank(st: Setting) -> float:
    """n = b*s/(d*q): the tokens of one micro-batch on a grid rank."""
    assert st.grid is not None
    q, d = st.grid
    return st.micro_batch * st.spec.seq / (d * q)


def check_grid(st: Setting) -> None:
    """What the grid runtime needs beyond ``Plan.validate`` (which checks the hidden size and
    the heads against q): each micro-batch splits into d*q row blocks, every product's features
    into q column chunks, and no sequence split on the sp axis (the grid does not combine with
    it)."""
    if st.grid is None:
        return
    q, d = st.grid
    mode = st.plan.tp_mode
    if st.sp > 1:
        raise PlanError(f"tp_mode={mode} with sp={st.sp}: the grid runtime does not combine "
                        "with sequence parallelism on the sp axis; use sp=1 or tp_mode=1d")
    if st.micro_batch % (d * q):
        raise PlanError(f"tp_mode={mode} splits each micro-batch's samples over depth x rows "
                        f"(d*q = {d * q}), but a micro-batch has {st.micro_batch}; choose "
                        f"microbatches so that (samples per data-parallel rank)/microbatches is "
                        f"a multiple of {d * q}")
    spec = st.spec
    widths = {w for product in spec.layer_products for w in product}
    if any(w % q for w in widths):
        raise PlanError(f"tp_mode={mode} splits every product's features into q={q} chunks; "
                        f"the model's widths {sorted(widths)} are not all divisible by {q}")
