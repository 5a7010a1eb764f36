"""What 2D (SUMMA / Optimus) and 2.5D (Tesseract) tensor parallelism should move and keep per
transformer layer and per rank on HF LLaMA, beside 1D's (``bench/tensor_parallel/formulas.py``).

Symbols as there (b, s, h, a, kv, dh = h/a, f, e; ``Shape`` is 1D's), plus the grid's side q
and depth d: tp = d*q^2, and a rank holds n = b*s/(d*q) tokens of h/q features. Collectives
follow the instrumented ``Collectives``' convention: the payload this rank hands to the op (a
broadcast's whole buffer on its root and on every receiver alike); ``wire`` turns them into the
bytes a rank sends. Derivations: docs/parallel/tensor.md, "2D and 2.5D communication and memory".
Torch-free, so the benchmark's parent and the tests use it without ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.tensor_parallel.formulas import PASSES, Shape, layer_activation_bytes, layer_collectives

Op = tuple[str, str, int, float]  # (op, group, calls, bytes per call)
STAT = 4  # norm statistics, the loss's per-token numbers and norm-weight gradients: fp32


@dataclass(frozen=True)
class GridShape:
    batch: int  # b: the batch of the whole tp group (1D: every rank's)
    seq: int  # s
    hidden: int  # h
    heads: int  # a
    kv_heads: int  # kv
    ffn: int  # f
    layers: int
    vocab: int
    side: int  # q
    depth: int = 1  # d (2D: 1)
    elem: int = 4  # e: fp32

    @property
    def tp(self) -> int:
        return self.depth * self.side ** 2

    @property
    def head_dim(self) -> int:  # dh
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        """n: tokens on one rank, b*s/(d*q)."""
        return self.batch * self.seq // (self.depth * self.side)

    @property
    def mode(self) -> str:
        return "2D" if self.depth == 1 else "2.5D"

    def one_d(self) -> Shape:
        """The same model and batch under 1D tensor parallelism at the same tp."""
        return Shape(self.batch, self.seq, self.hidden, self.heads, self.kv_heads, self.ffn,
                     self.layers, self.vocab, self.tp, self.elem)

    def sized(self, tokens: int, hidden: int) -> GridShape:
        """Another size of this model: b*s = ``tokens`` (per-layer bytes depend on b and s only
        through b*s), ``hidden`` with the same head width and f/h, kv/a."""
        heads = hidden // self.head_dim
        return replace(self, batch=tokens, seq=1, hidden=hidden, heads=heads,
                       kv_heads=heads * self.kv_heads // self.heads,
                       ffn=hidden * self.ffn // self.hidden)

    def describe(self) -> str:
        grid = f"{self.side}x{self.side}" + (f"x{self.depth}" if self.depth > 1 else "")
        return (f"{self.mode} {grid} (tp={self.tp}, n = b*s/(d*q) = {self.tokens} tokens per "
                f"rank)")


def describe_model(shape: GridShape) -> str:
    return (f"LLaMA {shape.layers} layers, h={shape.hidden}, {shape.heads} heads "
            f"({shape.kv_heads} kv, dh={shape.head_dim}), ffn {shape.ffn}, vocab {shape.vocab}, "
            f"seq {shape.seq}, batch {shape.batch}, fp32")


def products(shape: GridShape) -> list[tuple[int, int]]:
    """(m inputs, o outputs) of a LLaMA layer's seven linears: q, k, v, o, gate, up, down."""
    h, f, kvd = shape.hidden, shape.ffn, shape.kv_heads * shape.head_dim
    return [(h, h), (h, kvd), (h, kvd), (h, h), (h, f), (h, f), (f, h)]


def _summa(m: int, o: int, shape: GridShape, backward: bool, n: int) -> list[Op]:
    """One ``Linear2D`` (linear.py's docstring): q broadcasts of X[k,i,l] (n, m/q) along the
    row and of W[l,j] (m/q, o/q) along the column per pass; backward also reduce-scatters the
    q dX partials along the row and the q dW partials along the column, and (2.5D) all-reduces
    dW over the depth."""
    q, d, e = shape.side, shape.depth, shape.elem
    x, w = n * m / q * e, m * o / q ** 2 * e  # one activation block, one weight block
    ops = [("broadcast", "tp_row", q, x), ("broadcast", "tp_col", q, w)]
    if backward:
        ops += [("reduce_scatter", "tp_row", 1, q * x), ("reduce_scatter", "tp_col", 1, q * w)]
        if d > 1:
            ops.append(("all_reduce", "tp_dep", 1, w))
    return ops


def _rms_norm(shape: GridShape, backward: bool, n: int, count: int = 1) -> list[Op]:
    """``RMSNorm2D``: the mean square per token along the row (forward), the dot g.xhat per
    token (backward), and the weight chunk's gradient over the column and the depth."""
    chunk = shape.hidden // shape.side * STAT
    ops: list[Op] = [("all_reduce", "tp_row", count, n * STAT)]
    if backward:
        ops.append(("all_reduce", "tp_col", count, chunk))
        if shape.depth > 1:
            ops.append(("all_reduce", "tp_dep", count, chunk))
    return ops


def grid_layer_ops(shape: GridShape) -> dict[str, list[Op]]:
    """Per transformer layer: two RMSNorm2D and seven Linear2D (each linear its own SUMMA:
    q, k and v broadcast the same X blocks three times); attention is local."""
    n = shape.tokens
    out = {}
    for pass_ in PASSES:
        back = pass_ == "backward"
        ops = _rms_norm(shape, back, n, count=2)
        for m, o in products(shape):
            ops += _summa(m, o, shape, back, n)
        out[pass_] = ops
    return out


def one_d_layer_ops(shape: Shape) -> dict[str, list[Op]]:
    """Megatron's 1D per-layer collectives on "tp" (``bench.tensor_parallel.formulas``)."""
    return {p: [(op, "tp", c, b) for op, c, b in ops]
            for p, ops in layer_collectives(shape, sp=False).items()}


def grid_outside_ops(shape: GridShape, diagonal: bool) -> dict[str, list[Op]]:
    """Outside the layers: ``Embedding2D`` (ids gathered down the column, partials
    reduce-scattered along the row, a swap with the mirror rank off the diagonal; backward the
    swap, a gather along the row, fp32 dW over the depth), the final RMSNorm2D, the untied
    ``LMHead2D`` (a SUMMA over the vocabulary padded to q chunks) and ``grid_cross_entropy``
    (1D's three per-token all-reduces along the row; the token count, int64, and the loss
    share summed over the column and the depth)."""
    q, d, e, h, n = shape.side, shape.depth, shape.elem, shape.hidden, shape.tokens
    per = -(-shape.vocab // q)  # vocabulary rows per column, padded
    swap = [] if diagonal else [("send", "tp", 1, n * h / q * e), ("recv", "tp", 1, n * h / q * e)]
    predicted = shape.batch // (d * q) * (shape.seq - 1)
    sums = ["tp_col"] + (["tp_dep"] if d > 1 else [])
    forward = [("all_gather", "tp_col", 1, n * 8), ("reduce_scatter", "tp_row", 1, n * h * e),
               *swap, *_rms_norm(shape, False, n), *_summa(h, per * q, shape, False, n),
               ("all_reduce", "tp_row", 3, predicted * STAT),
               *[("all_reduce", g, 1, 8) for g in sums], *[("all_reduce", g, 1, 4) for g in sums]]
    backward = [*_summa(h, per * q, shape, True, n), *_rms_norm(shape, True, n), *swap,
                ("all_gather", "tp_row", 1, n * h / q * e)]
    if d > 1:
        backward.append(("all_reduce", "tp_dep", 1, per * h / q * STAT))
    return {"forward": forward, "backward": backward}


def by_key(ops: list[Op]) -> dict[tuple[str, str], tuple[int, int]]:
    """{(op, group): (calls, bytes)}: the form ``comm.stats`` deltas take."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for op, group, calls, nbytes in ops:
        c, b = out.get((op, group), (0, 0))
        out[(op, group)] = (c + calls, b + round(calls * nbytes))
    return out


def payload(ops: list[Op]) -> float:
    return sum(calls * nbytes for _, _, calls, nbytes in ops)


def group_sizes(shape: GridShape | Shape) -> dict[str, int]:
    if isinstance(shape, Shape):
        return {"tp": shape.tp}
    return {"tp": shape.tp, "tp_row": shape.side, "tp_col": shape.side, "tp_dep": shape.depth}


def wire_bytes(op: str, nbytes: float, g: int, ring: bool) -> float:
    """Bytes one rank sends for one op of ``nbytes`` payload on a group of g ranks.

    all-reduce: ring, 2(g-1)/g N; all-gather: (g-1) N_in; reduce-scatter: ring (g-1)/g N_in
    (``ring``), or gloo's, which all-reduces the whole input, 2(g-1)/g N_in; broadcast: every
    receiver gets B once, so g-1 copies leave some rank, (g-1)/g B per rank averaged over the
    roots (per rank exact over a SUMMA, where each rank roots one broadcast of q); send: N,
    recv: nothing."""
    if g == 1 or op in ("recv", "barrier"):
        return 0.0
    if op == "all_reduce" or (op == "reduce_scatter" and not ring):
        return 2 * (g - 1) / g * nbytes
    if op in ("reduce_scatter", "broadcast"):
        return (g - 1) / g * nbytes
    if op == "all_gather":
        return (g - 1) * nbytes
    if op == "send":
        return nbytes
    raise ValueError(f"no wire model for {op}")


def wire(ops: list[Op], sizes: dict[str, int], ring: bool = False) -> float:
    return sum(calls * wire_bytes(op, nbytes, sizes[group], ring)
               for op, group, calls, nbytes in ops)


def layer_wire(shape: GridShape | Shape, ring: bool = True) -> float:
    """Bytes a rank sends per layer, forward + backward."""
    ops = grid_layer_ops(shape) if isinstance(shape, GridShape) else one_d_layer_ops(shape)
    return sum(wire(ops[p], group_sizes(shape), ring) for p in PASSES)


def break_even_tokens(shape: GridShape, ring: bool = True) -> float | None:
    """b*s above which the grid sends fewer bytes per layer than 1D at the same tp: both are
    linear in b*s (the grid's weight blocks are the constant); None if never."""
    unit = shape.depth * shape.side  # b*s a multiple of d*q: whole tokens per rank

    def gap(t: int) -> float:  # grid - 1D
        sized = shape.sized(t, shape.hidden)
        return layer_wire(sized, ring) - layer_wire(sized.one_d(), ring)

    slope = (gap(2 * unit) - gap(unit)) / unit  # < 0 where 1D grows faster
    return unit - gap(unit) / slope if slope < 0 else None


# ---- memory per rank --------------------------------------------------------------------
def param_bytes_unsplit(shape: GridShape) -> int:
    """Untied embedding and head (V, h) each, per layer the seven matrices and two norm
    weights, the final norm."""
    h, e = shape.hidden, shape.elem
    matrices = sum(m * o for m, o in products(shape))
    return e * (2 * shape.vocab * h + shape.layers * (matrices + 2 * h) + h)


def param_bytes_grid(shape: GridShape) -> int:
    """Block (i, j) of every matrix (1/q^2, the same on every depth), chunk j of every norm
    weight (1/q: replicated down the column), the vocabulary padded to q chunks."""
    q, h, e = shape.side, shape.hidden, shape.elem
    matrices = sum(m * o for m, o in products(shape)) // q ** 2
    per = -(-shape.vocab // q)
    return e * (2 * per * h // q + shape.layers * (matrices + 2 * h // q) + h // q)


def param_bytes_1d(shape: Shape) -> int:
    """Matrices 1/t, the vocabulary padded to t chunks, norms replicated."""
    t, h, e = shape.tp, shape.hidden, shape.elem
    grid = GridShape(shape.batch, shape.seq, h, shape.heads, shape.kv_heads, shape.ffn,
                     shape.layers, shape.vocab, side=1)
    matrices = sum(m * o for m, o in products(grid)) // t
    per = -(-shape.vocab // t)
    return e * (2 * per * h + shape.layers * (matrices + 2 * h) + h)


def activation_terms_grid(shape: GridShape) -> dict[str, int]:
    """Bytes a LLaMA layer saves for backward on one grid rank, per op group (1D's terms with
    the grid's kernels): each RMSNorm2D keeps its input x and 1/rms (n per rank: replicated
    along the row) and its output, the q/k/v (gate/up) linears' shared input; no x*r copy, it
    is recomputed; attention keeps the rotated q, rotated k, v, its output (b/(d*q) rows,
    a/q heads) and the log-sum-exp; the MLP gate's and SiLU's outputs, up's and the product,
    (n, f/q) each. Every linear keeps only its input block."""
    q, e, n = shape.side, shape.elem, shape.tokens
    h, a, kv, dh, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    return {"norms": 2 * (2 * n * h // q + n) * e,
            "attention": (2 * n * a * dh + 2 * n * kv * dh + n * a) // q * e,
            "mlp": 4 * n * f // q * e}


def activation_bytes_grid(shape: GridShape) -> int:
    return sum(activation_terms_grid(shape).values())


def activation_bytes_unsplit(shape: GridShape) -> int:
    return layer_activation_bytes(replace(shape.one_d(), tp=1), sp=False)
