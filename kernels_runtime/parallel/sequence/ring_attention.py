"""Ring attention: exact softmax attention over a sequence sharded across the sp group.

Each rank keeps its queries and passes its key/value block around the ring (``ring_comms``);
after sp steps every query has met every key (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"). Blocks arrive in any order, so the forward keeps an online softmax per query
row, a running max, normaliser and weighted sum (Milakov & Gimelshein 2018, as in
FlashAttention, Dao et al. 2022): the result is the softmax over the whole sequence, and what
is kept for backward is q, k, v, the output and one log-sum-exp per row, never a score matrix.

The backward turns the ring again: each block's scores are recomputed from the saved
log-sum-exp, dQ accumulates locally, and dK/dV accumulators travel with their K/V block, each
rank adding its contribution; one last shift brings every accumulator home to its owner.

Work is cut into tiles: each rank's tokens are split in two halves (one tile if odd), which
under the zig-zag layout (``zigzag.py``) are exactly its early and late chunk. A tile pair in
which no query may see any key (all keys later, or all padding) is never computed; with
zig-zag every rank then computes the same number of pairs. Which pairs to compute is decided
once, before the ring turns (``block_schedule``), so the loop has no host syncs. Inside a
model the layout is known before any q exists: every rank's positions follow from the sequence
length, and every sp rank holds the whole padding mask, so ``plan_ring`` builds the key
positions, masks and schedule once per forward for all layers, with no collective and no
host read of device data (padding then prunes no tile; it is masked inside them).

Grouped-query attention (H query heads over Hkv key/value heads) is computed without expanding
K/V: queries are viewed as (b, Hkv, H/Hkv, s, d), the per-group contraction sums dK/dV over
the query heads that share them. Scores and accumulators are fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group
from kernels_runtime.parallel.sequence.ring_comms import Ring

Schedule = list[list[tuple[slice, slice]]]  # per ring step: (query tile, key tile) pairs


@dataclass(frozen=True)
class RingPlan:
    """What the ring needs besides q, k, v: every rank's key positions (P, s) and padding
    (P, b, s) on the device, and the tile schedule (host lists)."""

    keys_at: Tensor
    valid_at: Tensor | None
    schedule: Schedule


def plan_ring(positions: Sequence[Tensor], valid: Tensor | None, causal: bool, rank: int,
              device: torch.device) -> RingPlan:
    """The plan from every group rank's global positions (host tensors, in rank order) and the
    whole sequence's padding mask (b, s) or None: device ops only, no collective."""
    keys_at = torch.stack([p.to(torch.int64) for p in positions]).to(device)  # (P, s/sp)
    valid_at = None
    if valid is not None:
        valid = valid.to(device=device, dtype=torch.bool)
        valid_at = torch.stack([valid.index_select(1, p.to(device)) for p in positions])
    schedule = block_schedule(positions[rank].tolist(), [p.tolist() for p in positions], None,
                              causal, rank)
    return RingPlan(keys_at, valid_at, schedule)


def _tiles(length: int) -> list[slice]:
    """A rank's tokens in two halves (its two zig-zag chunks), or one tile when odd."""
    if length % 2 or length < 2:
        return [slice(0, length)]
    return [slice(0, length // 2), slice(length // 2, length)]


def block_schedule(q_positions: Sequence[int], key_positions: Sequence[Sequence[int]],
                   key_usable: Sequence[Sequence[bool]] | None, causal: bool,
                   rank: int) -> Schedule:
    """For each ring step, the (query tile, key tile) pairs that have a visible key.

    ``key_positions[o]`` are group rank o's key positions and ``key_usable[o][i]`` whether its
    i-th key is valid in some batch row (None: all are); at step j this rank holds rank
    (rank - j)'s keys. A key tile is skipped when none of its keys is usable, or, under causal
    attention, when its first usable key comes after the tile's last query."""
    size, steps = len(key_positions), []
    for step in range(size):
        owner = (rank - step) % size
        keys = key_positions[owner]
        pairs = []
        for kt in _tiles(len(keys)):
            usable = [p for i, p in enumerate(keys[kt], start=kt.start)
                      if key_usable is None or key_usable[owner][i]]
            for qt in _tiles(len(q_positions)):
                if usable and not (causal and min(usable) > max(q_positions[qt])):
                    pairs.append((qt, kt))
        steps.append(pairs)
    return steps


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """(b, H, s, ...) -> (b, Hkv, H/Hkv, s, ...): query head h uses key/value head h // (H/Hkv)."""
    b, heads = x.shape[:2]
    return x.reshape(b, kv_heads, heads // kv_heads, *x.shape[2:])


def _allowed(q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None,
             causal: bool) -> Tensor | None:
    """(b or 1, 1, 1, sq, sk) bool: which scores of a tile pair count; None when all do."""
    allowed = None
    if causal:
        allowed = (k_pos[None, :] <= q_pos[:, None])[None, None, None]  # (1, 1, 1, sq, sk)
    if k_valid is not None:
        padding = k_valid[:, None, None, None, :]  # (b, 1, 1, 1, sk)
        allowed = padding if allowed is None else allowed & padding
    return allowed


def _scores(q: Tensor, k: Tensor, scale: float, allowed: Tensor | None) -> Tensor:
    """(b, Hkv, g, sq, d) x (b, Hkv, sk, d) -> (b, Hkv, g, sq, sk), masked scores at -inf."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, -math.inf)


class _OnlineSoftmax:
    """Running max, normaliser and weighted value sum per query row, all fp32."""

    def __init__(self, q: Tensor) -> None:
        shape = q.shape[:-1]  # (b, Hkv, g, s)
        self.max = q.new_full(shape, -math.inf)
        self.norm = q.new_zeros(shape)
        self.acc = torch.zeros_like(q)  # (b, Hkv, g, s, d)

    def update(self, rows: slice, scores: Tensor, v: Tensor) -> None:
        """Fold one tile of keys into the rows' statistics; rows still without a visible key
        keep max -inf and norm 0 (the shift by 0 keeps exp() from producing NaN)."""
        m, norm, acc = self.max[..., rows], self.norm[..., rows], self.acc[..., rows, :]
        new = torch.maximum(m, scores.amax(-1))  # (b, Hkv, g, sq)
        shift = new.masked_fill(torch.isneginf(new), 0.0)
        p = torch.exp(scores - shift[..., None])  # (b, Hkv, g, sq, sk)
        rescale = torch.exp(m - shift)
        norm.mul_(rescale).add_(p.sum(-1))
        acc.mul_(rescale[..., None]).add_(torch.einsum("bhgqk,bhkd->bhgqd", p, v))
        m.copy_(new)

    def finish(self) -> tuple[Tensor, Tensor]:
        """Output (0 for rows that saw no key) and log-sum-exp (+inf there, so that the
        backward's exp(score - lse) is 0 and their gradient too)."""
        seen = self.norm > 0
        out = self.acc / torch.where(seen, self.norm, 1.0)[..., None]
        lse = torch.where(seen, self.max + self.norm.log(), math.inf)
        return out, lse


def _block_backward(q: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, k: Tensor, v: Tensor,
                    allowed: Tensor | None, scale: float,
                    grads: tuple[Tensor, Tensor, Tensor]) -> None:
    """Add one tile pair's share to (dq, dk, dv), in place (FlashAttention's backward)."""
    dq, dk, dv = grads
    p = torch.exp(_scores(q, k, scale, allowed) - lse[..., None])  # (b, Hkv, g, sq, sk)
    dv.add_(torch.einsum("bhgqk,bhgqd->bhkd", p, dout))
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout, v)
    ds = p * (dp - delta[..., None])  # d(loss)/d(scores)
    dq.add_(torch.einsum("bhgqk,bhkd->bhgqd", ds, k), alpha=scale)
    dk.add_(torch.einsum("bhgqk,bhgqd->bhkd", ds, q), alpha=scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor,
                k_positions: Tensor, key_valid: Tensor | None, causal: bool, scale: float,
                comm: Collectives, group: Group, plan: RingPlan | None) -> Tensor:
        ring = Ring(comm, group)
        q_at = q_positions.to(device=q.device, dtype=torch.int64)  # (s,)
        if plan is not None:
            keys_at, valid_at, schedule = plan.keys_at, plan.valid_at, plan.schedule
        else:
            keys_at, valid_at = ring.gather_keys(k_positions, key_valid, q.device)
            usable = valid_at.any(1).tolist() if valid_at is not None else None  # host reads
            schedule = block_schedule(q_at.tolist(), keys_at.tolist(), usable, causal, ring.rank)

        qg = _grouped(q.float(), k.shape[1])  # (b, Hkv, g, s, d)
        state = _OnlineSoftmax(qg)
        kv = [k, v]
        for step, pairs in enumerate(schedule):
            arriving = ring.shift(kv) if step + 1 < ring.size else None  # overlaps the compute
            owner = ring.owner(step)
            k32, v32 = kv[0].float(), kv[1].float()  # (b, Hkv, s, d)
            for qt, kt in pairs:
                allowed = _allowed(q_at[qt], keys_at[owner, kt],
                                   None if valid_at is None else valid_at[owner][:, kt], causal)
                state.update(qt, _scores(qg[:, :, :, qt], k32[:, :, kt], scale, allowed),
                             v32[:, :, kt])
            if arriving is not None:
                kv = arriving.wait()
        out, lse = state.finish()  # (b, Hkv, g, s, d), (b, Hkv, g, s)
        out = out.reshape(q.shape).to(q.dtype)  # (b, H, s, d)
        lse = lse.reshape(q.shape[:-1])  # (b, H, s) fp32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.schedule, ctx.causal, ctx.scale = ring, schedule, causal, scale
        ctx.masks = (q_at, keys_at, valid_at)  # O(b * s) integers, no score matrix
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, causal = ctx.ring, ctx.scale, ctx.causal
        q_at, keys_at, valid_at = ctx.masks
        kv_heads = k.shape[1]
        qg = _grouped(q.float(), kv_heads)  # (b, Hkv, g, s, d)
        dog = _grouped(dout.float(), kv_heads)  # (b, Hkv, g, s, d)
        lse = _grouped(lse, kv_heads)  # (b, Hkv, g, s)
        delta = (dog * _grouped(out.float(), kv_heads)).sum(-1)  # (b, Hkv, g, s): rowsum(dO*O)
        dq = torch.zeros_like(qg)
        kv, travelling, dkv = [k, v], None, None
        for step, pairs in enumerate(ctx.schedule):
            arriving = ring.shift(kv) if step + 1 < ring.size else None
            owner = ring.owner(step)
            k32, v32 = kv[0].float(), kv[1].float()  # (b, Hkv, s, d)
            mine = [torch.zeros_like(k32), torch.zeros_like(v32)]  # this rank's share
            for qt, kt in pairs:
                allowed = _allowed(q_at[qt], keys_at[owner, kt],
                                   None if valid_at is None else valid_at[owner][:, kt], causal)
                _block_backward(qg[:, :, :, qt], dog[:, :, :, qt], lse[..., qt],
                                delta[..., qt], k32[:, :, kt], v32[:, :, kt], allowed, scale,
                                (dq[:, :, :, qt], mine[0][:, :, kt], mine[1][:, :, kt]))
            if travelling is None:  # step 0: the accumulators start at this rank
                dkv = mine
            else:  # the accumulators of the block now held, from the rank before
                dkv = travelling.wait()
                if pairs:
                    dkv[0].add_(mine[0])
                    dkv[1].add_(mine[1])
            if ring.size > 1:  # pass them on with the block; the last shift brings them home
                travelling = ring.shift(dkv)
            if arriving is not None:
                kv = arriving.wait()
        dk, dv = travelling.wait() if travelling is not None else dkv
        return (dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None, None, None)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor,
                   k_positions: Tensor, key_valid: Tensor | None, causal: bool, scale: float,
                   comm: Collectives, group: Group, plan: RingPlan | None = None) -> Tensor:
    """Softmax attention of this rank's queries over the keys of every rank of ``group``.

    q: (b, H, s_local, d); k, v: (b, Hkv, s_local, d) with H % Hkv == 0; q_positions and
    k_positions: (s_local,) global positions of this rank's tokens (any layout, e.g.
    ``zigzag_positions``); key_valid: (b, s_local) bool, False for padding keys, or None.
    A query at position i sees keys at positions <= i when ``causal``. Every rank must pass the
    same shapes. Returns (b, H, s_local, d) in q's dtype; rows with no visible key are 0.
    ``plan`` (``plan_ring``) replaces the key exchange and host reads done here without one."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention takes q (b, H, s, d) and k, v (b, Hkv, s, d); got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, heads, s_q, d), (_, kv_heads, s_k, _) = q.shape, k.shape
    if heads % kv_heads or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} do not fit: batch and "
                         f"head dim must agree and {heads} query heads divide by {kv_heads}")
    if q_positions.shape != (s_q,) or k_positions.shape != (s_k,):
        raise ValueError(f"q_positions {tuple(q_positions.shape)} and k_positions "
                         f"{tuple(k_positions.shape)} must be ({s_q},) and ({s_k},)")
    if key_valid is not None and key_valid.shape != (b, s_k):
        raise ValueError(f"key_valid {tuple(key_valid.shape)} must be ({b}, {s_k}) or None")
    return _RingAttention.apply(q, k, v, q_positions, k_positions, key_valid, causal, scale,
                                comm, group, plan)
