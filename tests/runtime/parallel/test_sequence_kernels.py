"""The attention kernels of sequence parallelism against attention on the whole sequence.

What is protected: ring attention on real gloo ranks gives, for each rank's tokens, the
output and the gradients of q, k and v (1e-5 relative L2 in fp32 against a float64 softmax
over the gathered sequence) of causal attention under the zig-zag layout at sp=2 and sp=4 and
the contiguous layout, of bidirectional attention with padding keys (one sequence with
trailing padding), of causal attention with left padding (rows that see no key give 0 and
gradient 0, never NaN), with grouped-query attention (4 query heads, 2 kv heads), and in bf16
(2e-2, measured 5e-3: inputs, output and gradients are bf16). The forward keeps only q, k, v, the
output and the log-sum-exp. Fully masked tile pairs are not computed, and under zig-zag every
rank computes the same number. Ulysses at sp=2 (H=4, Hkv=2) and sp=4 (kv heads repeated) gives
SDPA's output and gradients. Indivisible lengths and head counts get errors that say what works.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels_runtime.parallel.sequence.ring_attention import block_schedule
from kernels_runtime.parallel.sequence.zigzag import (
    contiguous_positions,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)

from helpers.distributed import context
from helpers.tier_guard import on_ranks

B, H, D = 2, 4, 8


def _inputs(seq: int, kv_heads: int, padding: str) -> dict:
    """Full-sequence q, k, v, output gradient and key mask, the same on every rank."""
    g = torch.Generator().manual_seed(seq * 10 + kv_heads)
    valid = torch.ones(B, seq, dtype=torch.bool)
    if padding == "trailing":  # sequence 1 ends in padding, sequence 0 has scattered holes
        valid[1, seq - 5:] = False
        valid[0, 3::7] = False
    elif padding == "leading":  # sequence 1 starts with padding: its first queries see nothing
        valid[1, :3] = False
    return {"q": torch.randn(B, H, seq, D, generator=g),
            "k": torch.randn(B, kv_heads, seq, D, generator=g),
            "v": torch.randn(B, kv_heads, seq, D, generator=g),
            "dout": torch.randn(B, H, seq, D, generator=g),
            "valid": None if padding == "none" else valid}


def _reference(x: dict, causal: bool) -> dict:
    """float64 softmax attention on the whole sequence; rows with no visible key give 0."""
    q, k, v = (x[n].double().requires_grad_() for n in ("q", "k", "v"))
    seq, group = q.shape[2], q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allowed = torch.ones(B, 1, seq, seq, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(seq, seq, dtype=torch.bool).tril()
    if x["valid"] is not None:
        allowed &= x["valid"][:, None, None, :]
    scores = (q @ ke.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, -1e30)
    out = (scores.softmax(-1) @ ve) * allowed.any(-1, keepdim=True)
    out.backward(x["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ring(rank: int, world: int, layout: str, causal: bool, padding: str, kv_heads: int,
          dtype: torch.dtype, seq: int) -> dict:
    from kernels_runtime.parallel.sequence.ring_attention import ring_attention

    ctx = context(f"sp={world} sp_mode=ring")
    sp_rank = ctx.coord("sp")
    x = _inputs(seq, kv_heads, padding)
    layouts = {"zigzag": zigzag_positions, "contiguous": contiguous_positions}
    pos = layouts[layout](seq, sp_rank, world)
    q, k, v = (shard_sequence(x[n], pos, 2).to(dtype).requires_grad_() for n in "qkv")
    valid = None if x["valid"] is None else shard_sequence(x["valid"], pos, 1)
    out = ring_attention(q, k, v, q_positions=pos, k_positions=pos, key_valid=valid,
                         causal=causal, scale=D**-0.5, comm=ctx.comm, group=ctx.group("sp"))
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors]
    out.backward(shard_sequence(x["dout"], pos, 2).to(dtype))
    return {"pos": pos, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "saved": saved, "dtype": out.dtype}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


RING_CASES = [  # (sp, layout, causal, padding, kv heads, dtype, tolerance)
    (2, "zigzag", True, "none", 4, torch.float32, 1e-5),
    (4, "zigzag", True, "none", 4, torch.float32, 1e-5),
    (2, "contiguous", True, "none", 4, torch.float32, 1e-5),
    (2, "contiguous", False, "trailing", 4, torch.float32, 1e-5),
    (4, "zigzag", False, "trailing", 2, torch.float32, 1e-5),
    (2, "zigzag", True, "leading", 4, torch.float32, 1e-5),
    (2, "zigzag", True, "none", 2, torch.float32, 1e-5),
    (4, "zigzag", True, "trailing", 2, torch.float32, 1e-5),
    (2, "zigzag", True, "none", 2, torch.bfloat16, 2e-2),
]


@pytest.mark.parametrize("sp, layout, causal, padding, kv_heads, dtype, tol",
                         [on_ranks(case[0], *case) for case in RING_CASES])
def test_ring_attention_matches_attention_on_the_whole_sequence(
        ranks, sp, layout, causal, padding, kv_heads, dtype, tol):
    seq = 24 if sp == 2 else 32
    x = _inputs(seq, kv_heads, padding)
    ref = _reference(x, causal)
    results = ranks(sp).run(_ring, layout, causal, padding, kv_heads, dtype, seq, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["dtype"] == dtype
        assert result["saved"] == [(B, H, seq // sp, D), (B, kv_heads, seq // sp, D),
                                   (B, kv_heads, seq // sp, D), (B, H, seq // sp, D),
                                   (B, H, seq // sp)], "forward kept more than q, k, v, out, lse"
        for name in ("out", "dq", "dk", "dv"):
            got, want = result[name], ref[name].index_select(2, result["pos"])
            assert torch.isfinite(got).all(), (rank, name)
            assert _rel(got, want) < tol, (rank, name, _rel(got, want))
    if padding == "leading":  # queries 0..2 of sequence 1 see no key: output and dq are 0
        first = next(r for r in results if 0 in r["pos"].tolist())
        rows = (first["pos"] < 3).nonzero().flatten()
        assert first["out"][1][:, rows].abs().max() == 0
        assert first["dq"][1][:, rows].abs().max() == 0


def _pairs(schedule: list) -> int:
    return sum(len(step) for step in schedule)


def test_zigzag_balances_the_causal_tiles_and_masked_tiles_are_skipped():
    sp, seq = 4, 32
    for layout, balanced in ((zigzag_positions, True), (contiguous_positions, False)):
        keys = [layout(seq, r, sp).tolist() for r in range(sp)]
        work = [_pairs(block_schedule(keys[r], keys, None, True, r)) for r in range(sp)]
        assert (len(set(work)) == 1) == balanced, (layout.__name__, work)
        assert max(work) < 4 * sp  # 4 tile pairs per step when nothing is skipped
    keys = [contiguous_positions(seq, r, sp).tolist() for r in range(sp)]
    assert _pairs(block_schedule(keys[0], keys, None, True, 0)) == 3  # only its own diagonal
    assert _pairs(block_schedule(keys[0], keys, None, False, 0)) == 4 * sp
    unusable = [[True] * 8, [False] * 8, [True] * 4 + [False] * 4, [True] * 8]
    assert [len(s) for s in block_schedule(keys[0], keys, unusable, False, 0)] == [4, 4, 2, 0]


def test_zigzag_layout_shards_and_rebuilds_the_sequence():
    assert zigzag_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert contiguous_positions(12, 2, 3).tolist() == [8, 9, 10, 11]
    x = torch.randn(2, 3, 24, 5)
    for layout in (zigzag_positions, contiguous_positions):
        positions = [layout(24, r, 4) for r in range(4)]
        pieces = [shard_sequence(x, p, 2) for p in positions]
        assert torch.equal(unshard_sequence(pieces, positions, 2), x)


def test_indivisible_sequences_get_errors_that_say_what_works():
    with pytest.raises(ValueError, match=r"sequence length 30 .*sp=4.* 24 or 32"):
        zigzag_positions(30, 0, 4)
    with pytest.raises(ValueError, match=r"sequence length 10 .*sp=4.* 8 or 12"):
        contiguous_positions(10, 1, 4)
    with pytest.raises(ValueError, match=r"rank 2 is not in a group of sp=2"):
        zigzag_positions(16, 2, 2)


def _ulysses(rank: int, world: int, kv_heads: int, seq: int) -> dict:
    from kernels_runtime.parallel.sequence.ulysses import ulysses_attention

    ctx = context(f"sp={world} sp_mode=all_to_all")
    comm, group = ctx.comm, ctx.group("sp")
    pos = contiguous_positions(seq, ctx.coord("sp"), world)
    x = _inputs(seq, kv_heads, "none")
    q, k, v = (shard_sequence(x[n], pos, 2).requires_grad_() for n in "qkv")

    def attend(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)

    out = ulysses_attention(q, k, v, attend, comm, group)
    out.backward(shard_sequence(x["dout"], pos, 2))
    try:
        ulysses_attention(q[:, :3], k[:, :1], v[:, :1], attend, comm, group)
        error = ""
    except ValueError as err:
        error = str(err)
    return {"pos": pos, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "error": error}


@pytest.mark.parametrize("sp, kv_heads", [(2, 2), on_ranks(4, 4, 2), on_ranks(4, 4, 4)])
def test_ulysses_matches_attention_on_the_whole_sequence(ranks, sp, kv_heads):
    seq = 16
    ref = _reference(_inputs(seq, kv_heads, "none"), causal=True)
    for result in ranks(sp).run(_ulysses, kv_heads, seq, timeout_s=60):
        for name in ("out", "dq", "dk", "dv"):
            got, want = result[name], ref[name].index_select(2, result["pos"])
            assert _rel(got, want) < 1e-5, (name, _rel(got, want))
        valid = "[1, 3]"
        assert "3 attention heads" in result["error"] and f"sp={sp}" in result["error"]
        assert valid in result["error"], result["error"]
