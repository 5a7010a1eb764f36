"""DeepSpeed-Ulysses: attention over a sharded sequence by trading sequence for heads.

Attention mixes tokens but not heads, so before attention one all-to-all turns each rank's
(b, H, s/sp, d) sequence shard into (b, H/sp, s, d): every token of H/sp heads (Jacobs et al.
2023, "DeepSpeed Ulysses"). The caller's own attention then runs unchanged on the full
sequence, and a second all-to-all turns its output back. Both all-to-alls are differentiable
(``comm.autograd.all_to_all``), so the backward is the same exchange in reverse.

The gathered sequence is the ranks' shards in rank order, so the caller's mask must be built
for that order: the contiguous layout gives the natural one.

Grouped-query attention: rank r gets query heads [r*H/sp, (r+1)*H/sp), which use key/value
heads h // (H/Hkv). When Hkv divides by sp the kv heads split the same way. Otherwise every kv
head is repeated f times, f the smallest divisor of the group size H/Hkv with Hkv*f divisible by
sp: query head h then uses repeated head h // (H/(Hkv*f)), a copy of kv head h // (H/Hkv), and
each rank's query heads map onto exactly the repeated heads it receives. The repeat's backward
sums the copies' gradients, so dK/dV stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.autograd import all_to_all
from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def kv_repeats(heads: int, kv_heads: int, sp: int) -> int:
    """How many times to repeat each kv head so that they split over sp with the queries."""
    if heads % sp:
        valid = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(f"Ulysses splits the {heads} attention heads over sp={sp} ranks, but "
                         f"{heads} does not divide by {sp}; sp in {valid} works")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide by {kv_heads} key/value heads")
    group = heads // kv_heads
    return next(f for f in range(1, group + 1) if group % f == 0 and kv_heads * f % sp == 0)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, attend: Attend, comm: Collectives,
                      group: Group) -> Tensor:
    """Attention over the full sequence from sequence shards, one all-to-all each way.

    q: (b, H, s/sp, d); k, v: (b, Hkv, s/sp, d). ``attend(q, k, v)`` receives (b, H/sp, s, d)
    queries and (b, Hkv'/sp, s, d) keys/values (Hkv' = Hkv times ``kv_repeats``; it must handle
    H/Hkv' query heads per kv head, e.g. ``scaled_dot_product_attention(..., enable_gqa=True)``)
    and returns (b, H/sp, s, d). Returns (b, H, s/sp, d)."""
    sp = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    repeats = kv_repeats(heads, kv_heads, sp)
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)  # (b, Hkv*f, s/sp, d)
        v = v.repeat_interleave(repeats, dim=1)
    q_full = all_to_all(q, comm, group, scatter_dim=1, gather_dim=2)  # (b, H/sp, s, d)
    k_full = all_to_all(k, comm, group, scatter_dim=1, gather_dim=2)  # (b, Hkv*f/sp, s, d)
    v_full = all_to_all(v, comm, group, scatter_dim=1, gather_dim=2)
    out = attend(q_full, k_full, v_full)  # (b, H/sp, s, d)
    return all_to_all(out, comm, group, scatter_dim=2, gather_dim=1)  # (b, H, s/sp, d)
