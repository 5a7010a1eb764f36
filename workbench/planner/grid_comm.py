"""Time of a 2D / 2.5D grid's collectives per step, one ``TimeItem`` per kind and grid axis.

Per micro-batch, with n = b*s/(d*q) tokens per rank and e bytes per element (``grid.py`` has the
layout and the per-layer bytes):

- every product (the layers' and the LM head's): forward q broadcasts of X blocks along the row
  and q of W blocks along the column; backward the same again, a reduce-scatter of the q dX
  partials along the row and one of the q dW partials along the column, and under 2.5D an
  all-reduce of dW over the depth; recomputation repeats the forward's broadcasts. The runtime
  issues step l+1's broadcasts before multiplying step l's blocks (``grid_comms.summa_steps``),
  so q-1 of every q broadcasts may hide behind the products (windows ``forward_products`` /
  ``backward_products`` in ``cost_model``); the first step's and the reduce-scatters wait.
- norms: LayerNorm all-reduces 2 statistics per token along the row forward and 2 (one packed
  tensor) backward, RMSNorm 1 and 1; the gradients of biases and norm weights (chunk j, held by
  every row and depth) are all-reduced over the column and the depth.
- embedding (``Embedding2D``): forward the ids all-gathered along the column, the looked-up
  partials reduce-scattered along the row and one p2p swap with the transposed rank; backward
  the swap, an all-gather along the row and, under 2.5D, the fp32 dW over the depth. Learned
  positions keep hidden chunk j on every row (``ChunkEmbedding``): their gradient is
  all-reduced down the column (and over the depth).
- loss: the grid's vocabulary-parallel cross-entropy (the paper's profile) all-reduces 3 numbers
  per token along the row and 2 scalars over column and depth; an HF output's logits are
  gathered whole (row, then column, then depth) for the model's own loss, as 1D gathers them.

Broadcasts cost ``timing.ring_seconds``'s chain (every non-root receives the whole block); row
and column broadcasts are summed although they run on different groups (they may share links).
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.planner.activations import profile_for
from workbench.planner.grid import tokens_per_rank
from workbench.planner.setting import Setting, TimeItem
from workbench.planner.timing import p2p_seconds, ring_seconds

AXES = {"row": "tp_row", "col": "tp_col", "dep": "tp_dep"}
Item = Callable[..., TimeItem]  # item(name, axis, op, bytes per op, count, phase, window=None)


def grid_comm(st: Setting) -> list[TimeItem]:
    """The grid's collectives per step (all micro-batches)."""
    if st.grid is None:
        return []
    q, d = st.grid
    spec, e, m = st.spec, st.elem, st.microbatches
    n = tokens_per_rank(st)
    layers = spec.layers * m
    forwards = layers * (2 if st.plan.activation_checkpointing else 1)  # recomputed forward
    spans = {"row": (q, 1), "col": (q, q), "dep": (d, q * q)}  # (ranks, stride) per axis

    def item(name: str, axis: str, op: str, nbytes: float, count: float, phase: str,
             window: str | None = None) -> TimeItem:
        """``count`` collectives of ``op`` over ``axis``, each handed ``nbytes``."""
        ranks, stride = spans[axis]
        link = st.hw.link(op, ranks, stride)
        seconds = ring_seconds(op, nbytes * count, ranks, link.bandwidth, link.latency, count)
        return TimeItem(name, "comm", seconds, phase=phase, window=window, axis=AXES[axis],
                        count=max(1, round(count)), nbytes=nbytes * count, note=op)

    items: list[TimeItem] = []
    vocab_cols = -(-spec.vocab // q) * q  # the head's outputs, padded to q chunks
    # (products, passes, broadcast passes inside backward: its own + a recomputed forward's)
    groups = [(spec.layer_products, layers, forwards), ([(spec.hidden, vocab_cols)], m, m)]
    for products, passes, backward_passes in groups:
        for i, o in products:
            x, w = n * i / q * e, i * o / q**2 * e  # one activation block, one weight block
            items += _broadcasts(item, x, w, q, "forward", passes)
            items += _broadcasts(item, x, w, q, "backward", backward_passes)
            items += [item("grid dX reduce-scatters", "row", "reduce_scatter", q * x, passes,
                           "backward"),
                      item("grid dW reduce-scatters", "col", "reduce_scatter", q * w, passes,
                           "backward")]
            if d > 1:
                items.append(item("grid dW depth all-reduces", "dep", "all_reduce", w, passes,
                                  "backward"))
    items += _norms(st, item, n, layers, forwards)
    items += _embedding(st, item, n)
    items += _loss(st, item, n)
    return _merge(items)


def _broadcasts(item: Item, x: float, w: float, q: int, phase: str, passes: int) -> list[TimeItem]:
    """A product's SUMMA broadcasts in ``passes`` SUMMAs: each one's first step exposed, the
    other q-1 steps in flight during the products of the same phase."""
    out = []
    for axis, block, what in (("row", x, "X"), ("col", w, "W")):
        out += [item(f"grid {phase} {what} broadcasts (first step)", axis, "broadcast", block,
                     passes, phase),
                item(f"grid {phase} {what} broadcasts (in flight)", axis, "broadcast", block,
                     passes * (q - 1), phase, f"{phase}_products")]
    return out


def _norms(st: Setting, item: Item, n: float, layers: int, forwards: int) -> list[TimeItem]:
    """Statistics along the row for the layers' two norms and the final one, and the sums of
    the replicated gradients (norm weights, packed with LayerNorm's bias, and each product's
    bias) over the column and the depth."""
    spec, e, (q, d), m = st.spec, st.elem, st.grid, st.microbatches
    stats = 1 if spec.gated else 2  # RMSNorm: mean square; LayerNorm: mean, centred square
    out = [item("grid norm statistics all-reduces", "row", "all_reduce", n * 4,
                stats * (2 * forwards + m), "forward"),
           item("grid norm statistics all-reduces", "row", "all_reduce", n * 4 * stats,
                2 * layers + m, "backward")]
    tensors = 2 + (0 if spec.gated else len(spec.layer_products))  # per layer
    count = tensors * layers + m
    per_tensor = (spec.layer_vector_params * layers + spec.final_norm_params * m) / q * e \
        / count
    out.append(item("grid bias / norm gradient all-reduces", "col", "all_reduce", per_tensor,
                    count, "backward"))
    if d > 1:
        out.append(item("grid bias / norm gradient depth all-reduces", "dep", "all_reduce",
                        per_tensor, count, "backward"))
    return out


def _embedding(st: Setting, item: Item, n: float) -> list[TimeItem]:
    spec, e, (q, d), m = st.spec, st.elem, st.grid, st.microbatches
    out = [item("grid embedding ids all-gather", "col", "all_gather", q * n * 8, m, "forward"),
           item("grid embedding reduce-scatter", "row", "reduce_scatter", n * spec.hidden * e,
                m, "forward"),
           item("grid embedding dY all-gather", "row", "all_gather", n * spec.hidden * e, m,
                "backward")]
    link = st.hw.link("p2p", q, q)
    swap = n * spec.hidden / q * e * m  # off the diagonal: (q-1)/q of the ranks wait
    for phase in ("forward", "backward"):
        out.append(TimeItem(f"grid embedding mirror swap ({phase})", "comm",
                            p2p_seconds(swap, link.bandwidth, link.latency, m),
                            phase=phase, axis="tp", count=m, nbytes=swap, note="p2p"))
    if d > 1:
        out.append(item("grid embedding dW depth all-reduce", "dep", "all_reduce",
                        -(-spec.vocab // q) * spec.hidden / q * 4, m, "backward"))
    if spec.positions:
        chunk = spec.positions * spec.hidden / q * e
        out += [item("grid position-embedding gradient all-reduce", axis, "all_reduce", chunk,
                     m, "backward") for axis in ("col", "dep")[:2 if d > 1 else 1]]
    return out


def _loss(st: Setting, item: Item, n: float) -> list[TimeItem]:
    spec, e, (q, d), m = st.spec, st.elem, st.grid, st.microbatches
    if profile_for(spec).vocab_parallel_loss:
        out = [item("grid loss statistics all-reduces", "row", "all_reduce", n * 4, 3 * m,
                    "forward"),
               item("grid loss count and sum all-reduces", "col", "all_reduce", 8, 2 * m,
                    "forward")]
        if d > 1:
            out.append(item("grid loss count and sum depth all-reduces", "dep", "all_reduce",
                            8, 2 * m, "forward"))
        return out
    row = n * spec.vocab * e  # this row block's logits, gathered over the row
    out = [item("grid logits all-gather (row)", "row", "all_gather", row, m, "forward"),
           item("grid logits all-gather (column)", "col", "all_gather", q * row, m, "forward")]
    if d > 1:
        out.append(item("grid logits all-gather (depth)", "dep", "all_gather", d * q * row, m,
                        "forward"))
    return out


def _merge(items: list[TimeItem]) -> list[TimeItem]:
    """One item per (name, phase, window, axis): the products' items add up."""
    merged: dict[tuple, TimeItem] = {}
    for t in items:
        key = (t.name, t.phase, t.window, t.axis)
        if key in merged:
            old = merged[key]
            merged[key] = TimeItem(t.name, "comm", old.seconds + t.seconds, phase=t.phase,
                                   window=t.window, axis=t.axis, count=old.count + t.count,
                                   nbytes=old.nbytes + t.nbytes, note=t.note)
        else:
            merged[key] = t
    return list(merged.values())
