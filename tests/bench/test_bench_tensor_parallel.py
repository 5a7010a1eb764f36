"""The counts behind ``python -m bench tensor_parallel``, on its quick model (HF LLaMA, 2
layers, h=128, GQA 4/2 heads, tp=2) on 2 real gloo ranks; no timing.

What is protected:
- per transformer layer, our instrumented collectives move exactly Megatron's forward bytes
  (two all-reduces of (b, s, h): attention and MLP outputs), and outside the layers exactly the
  vocabulary-parallel embedding's all-reduce, the LM head's input gradient and the loss's three
  all-reduces of one fp32 per predicted token;
- backward: Megatron's two all-reduces of (b, s, h) per layer, one per shared input (q/k/v
  share one, gate/up the other), not one per column-parallel linear;
- under sequence parallelism (split_gather): forward two all-gathers and two reduce-scatters
  of (b, s, h) per layer, backward the same plus the norms' gradient all-reduces;
- what the OS saw each rank write to its sockets (``/proc/self/io`` wchar) is gloo's ring wire
  bytes for the counted ops plus its message headers: between the wire bytes and 1 KiB more
  per op (48-byte headers on 12 messages per all-reduce on 2 ranks, 576 bytes, measured);
- bytes saved for backward per layer are within 10% of the adapted Korthikanti et al. formula.
"""

from __future__ import annotations

import pytest

from bench.common.layer_meter import layer_delta
from bench.tensor_parallel.formulas import (
    layer_activation_bytes,
    layer_collectives,
    outside_collectives,
    rope_table_bytes,
    wire_total,
)
from bench.tensor_parallel.run import outside_delta, quick_shape

SHAPE = quick_shape()
HEADER_SLACK = 1024  # bytes per op on top of the wire bytes (576 measured for an all-reduce)


@pytest.fixture(scope="module")
def counted(ranks):
    from bench.tensor_parallel.ranks import count

    from helpers.distributed import process_comm

    return ranks(2).run(count, SHAPE, ("ours 1D", "ours 1D+SP"), process_comm)


def _as_ops(ops: dict) -> dict:
    return {op: (calls, nbytes) for op, (calls, nbytes) in ops.items()}


def _want(ops: list) -> dict:
    return {op: (calls, calls * nbytes) for op, calls, nbytes in ops}


@pytest.mark.parametrize("variant, sp", [("ours 1D", False), ("ours 1D+SP", True)])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_collectives_per_layer_are_megatrons(counted, variant, sp, pass_):
    want = _want(layer_collectives(SHAPE, sp=sp)[pass_])
    for result in counted:  # the last block also joins the sequence under SP: the least one
        assert _as_ops(layer_delta(result[variant]["blocks"], pass_)["ops"]) == want


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_collectives_outside_the_layers_are_the_embedding_head_and_loss(counted, pass_):
    want = {}
    for op, calls, nbytes in outside_collectives(SHAPE, sp=False)[pass_]:
        c, b = want.get(op, (0, 0))
        want[op] = (c + calls, b + calls * nbytes)
    for result in counted:
        assert _as_ops(outside_delta(result["ours 1D"], pass_)["ops"]) == want


def test_socket_writes_are_gloos_wire_bytes_of_the_counted_ops(counted):
    for result in (r[v] for r in counted for v in ("ours 1D", "ours 1D+SP")):
        readings = [b[p] for b in result["blocks"] for p in ("forward", "backward")]
        readings += [outside_delta(result, p) for p in ("forward", "backward")]
        for reading in readings:
            ops = [(op, calls, nbytes / calls) for op, (calls, nbytes) in reading["ops"].items()]
            wire = wire_total(ops, SHAPE.tp)
            calls = sum(c for _, c, _ in ops)
            assert wire <= reading["wchar"] <= wire + HEADER_SLACK * calls, (reading, wire)


def test_saved_activations_per_layer_match_the_formula(counted):
    want = layer_activation_bytes(SHAPE, sp=False)
    for result in (r["ours 1D"] for r in counted):
        first, *rest = result["saved"]  # the first block also holds the RoPE tables all share
        for saved in [first - rope_table_bytes(SHAPE), *rest]:
            assert abs(saved / want - 1) <= 0.10, (saved, want)
