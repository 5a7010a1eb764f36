"""What 1D tensor parallelism (and Megatron sequence parallelism on top) should move and keep,
per transformer layer and per rank, in b (batch), s (sequence), h (hidden), t (tp degree), a
(query heads), kv (key/value heads), d (head width), f (MLP width) and e (bytes per element).

The derivations are in docs/parallel/tensor.md, "Tensor-parallel communication and activation
formulas". Collectives follow the instrumented ``Collectives``' convention: the bytes of an op
are the payload this rank hands to it (an all-gather's input, a reduce-scatter's full input).
Torch-free, so the benchmark's parent process and the tests can use it without ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

PASSES = ("forward", "backward")


@dataclass(frozen=True)
class Shape:
    batch: int  # b, per rank (tp ranks see the same batch)
    seq: int  # s
    hidden: int  # h
    heads: int  # a
    kv_heads: int  # kv
    ffn: int  # f
    layers: int
    vocab: int
    tp: int  # t
    elem: int = 4  # e: fp32

    @property
    def head_dim(self) -> int:  # d
        return self.hidden // self.heads

    @property
    def bsh(self) -> int:
        """Bytes of one (b, s, h) activation."""
        return self.batch * self.seq * self.hidden * self.elem

    def describe(self) -> str:
        return (f"LLaMA {self.layers} layers, h={self.hidden}, {self.heads} heads "
                f"({self.kv_heads} kv, d={self.head_dim}), ffn {self.ffn}, vocab {self.vocab}, "
                f"seq {self.seq}, batch {self.batch}, tp={self.tp}, fp32")


Ops = list[tuple[str, int, int]]  # (op, calls, bytes per call)


def layer_collectives(shape: Shape, sp: bool) -> dict[str, Ops]:
    """Megatron's per-layer collectives on the tp group (Shoeybi et al. 2019; Korthikanti et
    al. 2022): 1D: forward g after attention and after the MLP (all-reduce of (b, s, h)),
    backward f before each (the gradient of the column-parallel linears' shared input). SP:
    each all-reduce becomes an all-gather of the (b, s/t, h) shard plus a reduce-scatter of
    (b, s, h), in both passes (backward swaps which is which); in backward also the two norms'
    weight gradients, each rank's covering only its tokens, are summed (all-reduce of h; Megatron
    batches these once per step)."""
    n, t = shape.bsh, shape.tp
    if not sp:
        return {"forward": [("all_reduce", 2, n)], "backward": [("all_reduce", 2, n)]}
    both = [("all_gather", 2, n // t), ("reduce_scatter", 2, n)]
    norms = ("all_reduce", 2, shape.hidden * shape.elem)
    return {"forward": list(both), "backward": [*both, norms]}


def outside_collectives(shape: Shape, sp: bool) -> dict[str, Ops]:
    """Collectives outside the layers: the vocabulary-parallel embedding (a sum over tp of
    each rank's rows), the LM head's input (f; under SP an all-gather of the final norm's
    shard) and the vocabulary-parallel cross-entropy (three all-reduces of one fp32 per
    predicted token: the row maximum, the sum of exponentials, the target's logit)."""
    n, t = shape.bsh, shape.tp
    loss = ("all_reduce", 3, shape.batch * (shape.seq - 1) * 4)
    if not sp:
        return {"forward": [("all_reduce", 1, n), loss], "backward": [("all_reduce", 1, n)]}
    return {"forward": [("reduce_scatter", 1, n), ("all_gather", 1, n // t), loss],
            "backward": [("all_gather", 1, n // t), ("reduce_scatter", 1, n)]}


def total(ops: Ops) -> int:
    return sum(calls * nbytes for _, calls, nbytes in ops)


def wire_bytes(op: str, nbytes: int, t: int) -> float:
    """Bytes one rank writes to its sockets for one op of ``nbytes`` on gloo (TCP, ring).

    all-reduce: ring reduce-scatter then ring all-gather, 2(t-1)/t of the buffer;
    all-gather: t-1 times this rank's input; reduce-scatter: gloo reduces the whole input with
    its all-reduce and keeps the slice, so 2(t-1)/t of the input (an ideal ring reduce-scatter
    would send (t-1)/t). Messages add 48-byte headers (12 per all-reduce on 2 ranks), not
    counted here."""
    if op == "all_reduce" or op == "reduce_scatter":
        return 2 * (t - 1) / t * nbytes
    if op == "all_gather":
        return (t - 1) * nbytes
    if op == "barrier":
        return 0.0
    raise ValueError(f"no wire model for {op}")


def wire_total(ops: Ops, t: int) -> float:
    return sum(calls * wire_bytes(op, nbytes, t) for op, calls, nbytes in ops)


def layer_activation_terms(shape: Shape, sp: bool) -> dict[str, int]:
    """Bytes one HF LLaMA decoder layer saves for backward on one rank, per op group.

    Korthikanti et al. 2022 (section 4.1) adapted to RMSNorm, SwiGLU, grouped-query attention
    and sdpa's flash kernel, in fp32 and without dropout:
    - each RMSNorm keeps its input x, the normalized x*r, its 1/rms r (b, s) and the output
      w * x r that the next linears keep as their shared input: 3 bsh + bs elements;
    - attention keeps the rotated q (b, s, a d / t), the rotated k and v (b, s, kv d / t each),
      its output (b, s, a d / t, also the output projection's input) and the log-sum-exp
      (b, a / t, s): no s x s scores (the paper's 5 a s / h term);
    - the MLP keeps gate's output (SiLU's input), SiLU's output, up's output and their
      product (down's input): 4 b s f / t.
    1D splits attention and the MLP over t; Megatron SP also splits the norms and keeps the
    column-parallel linears' input as its (b, s/t, h) shard (gathered again in backward)."""
    b, s, t, e = shape.batch, shape.seq, shape.tp, shape.elem
    h, a, kv, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    norms = 2 * (3 * b * s * h + b * s) * e
    attention = (2 * b * s * a * d + 2 * b * s * kv * d + b * a * s) * e // t
    mlp = 4 * b * s * f * e // t
    return {"norms": norms // t if sp else norms, "attention": attention, "mlp": mlp}


def layer_activation_bytes(shape: Shape, sp: bool) -> int:
    return sum(layer_activation_terms(shape, sp).values())


def rope_table_bytes(shape: Shape) -> int:
    """cos and sin (1, s, d), shared by every layer: autograd finds them saved in the first."""
    return 2 * shape.seq * shape.head_dim * shape.elem
