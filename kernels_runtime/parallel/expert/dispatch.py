"""Expert parallelism's algorithm: route tokens, send them to their experts' ranks, bring them back.

A mixture-of-experts layer (Shazeer et al. 2017; Mixtral, Jiang et al. 2024) sends each token to
the top-k of E experts its router picks. Under expert parallelism (GShard, Lepikhin et al. 2020)
the ep ranks of a group each hold E/ep experts and their own tokens, and one step is:

1. ``route``: softmax over all E router logits, keep the top k, renormalize them to sum to 1
   (the order of transformers' ``MixtralTopKRouter``, so the weights match HF's bit for bit).
2. ``dispatch``: each (token, choice) slot becomes a row; rows are sorted by expert, which sorts
   them by destination rank since experts are laid out in rank order; the row counts are
   exchanged and the rows sent with one variable-split all-to-all (``dispatch_comms.py``).
   Dropless: no capacity, no row dropped or padded.
3. ``run_local_experts``: received rows come grouped by source rank, then by local expert;
   they are regrouped by local expert and each expert runs on its rows (``expert_compute.py``:
   two grouped GEMMs for all local experts on a GPU, a loop elsewhere), then put back in
   arrival order.
4. ``combine``: the reverse all-to-all returns each row to its token's rank, the sort is
   undone, and each token sums its k rows weighted by its routing weights.

The split sizes are read on the host (torch's all-to-all takes Python lists), one small sync
per layer: the per-expert row counts (E,) are read whole, so the send splits are their sums per
rank and the counts themselves are the layer's expert load (``Dispatched.counts``, which
``moe_forward`` hands to ``on_counts``: the telemetry's tokens per expert) at no extra sync.
Shapes: t tokens on this rank, h hidden, k choices, n rows received.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group
from kernels_runtime.parallel.expert.dispatch_comms import all_to_all_v, exchange_counts

# each local expert's rows [(m_e, h)] -> their outputs [(m_e, h)], in one call: a module called
# once per layer, so ZeRO-3 gathers the local experts' weights once (FSDP2 hooks per call)
ExpertFn = Callable[[list[Tensor]], list[Tensor]]


@dataclass(frozen=True)
class Routing:
    """The router's choice for each token: ``experts`` (t, k) ids, ``weights`` (t, k) float32."""

    experts: Tensor
    weights: Tensor


@dataclass(frozen=True)
class Dispatched:
    """What ``combine`` needs to undo ``dispatch``: the sort of the slots and the split sizes."""

    order: Tensor  # (t*k,) slot indices sorted by expert
    counts: list[int]  # (E,) rows this rank sent to each expert (global index): its load
    send: list[int]  # rows sent to each rank of the group
    recv: list[int]  # rows received from each rank
    recv_counts: Tensor  # (ep, E/ep) rows received from each rank for each local expert


def route(logits: Tensor, top_k: int) -> Routing:
    """Mixtral's routing from router logits (t, E): softmax in float32, top-k, renormalized."""
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be between 1 and the {logits.shape[-1]} experts")
    probs = torch.softmax(logits.float(), dim=-1)  # (t, E)
    top, experts = torch.topk(probs, top_k, dim=-1)  # (t, k)
    return Routing(experts=experts, weights=top / top.sum(dim=-1, keepdim=True))


def dispatch(hidden: Tensor, routing: Routing, num_experts: int, comm: Collectives,
             group: Group) -> tuple[Tensor, Dispatched]:
    """Send each slot's token row (t, h) to the rank of its expert; returns the rows received
    (n, h), grouped by source rank then local expert, and the record to undo it."""
    ep = dist.get_world_size(group)
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not divide over ep={ep} ranks: choose an ep "
                         f"that divides {num_experts}")
    k = routing.experts.shape[-1]
    slots = routing.experts.reshape(-1)  # (t*k,) expert of each slot, token-major
    order = torch.argsort(slots, stable=True)  # (t*k,)
    rows = hidden.index_select(0, order // k)  # (t*k, h) sorted by expert, so by rank
    counts = torch.bincount(slots, minlength=num_experts)  # (E,)
    recv_counts = exchange_counts(counts, comm, group)  # (ep, E/ep)
    per_expert = counts.tolist()  # the host read the send splits need anyway, whole
    local = num_experts // ep
    send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ep)]
    recv = recv_counts.sum(dim=1).tolist()
    received = all_to_all_v(rows, comm, group, send, recv)  # (n, h)
    return received, Dispatched(order=order, counts=per_expert, send=send, recv=recv,
                                recv_counts=recv_counts)


def _inverse(order: Tensor) -> Tensor:
    """The permutation that undoes ``x.index_select(0, order)``."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def run_local_experts(rows: Tensor, recv_counts: Tensor, expert: ExpertFn) -> Tensor:
    """Each local expert on its rows: (n, h) -> (n, h), in the order the rows arrived.

    Every local expert runs, on zero rows if none came, so each expert parameter is part of
    the graph on every step (its gradient is zeros, never missing)."""
    ep, local = recv_counts.shape
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        recv_counts.reshape(-1).to(rows.device))  # (n,) local expert of each received row
    order = torch.argsort(expert_of_row, stable=True)  # (n,)
    grouped = rows.index_select(0, order).split(recv_counts.sum(dim=0).tolist())
    out = torch.cat(expert(list(grouped)))  # (n, h) by expert
    return out.index_select(0, _inverse(order))  # (n, h) in arrival order


def combine(rows: Tensor, routing: Routing, record: Dispatched, comm: Collectives,
            group: Group, dtype: torch.dtype) -> Tensor:
    """Bring expert outputs (n, h) back to their tokens: (t, h), each token's k rows summed
    with its routing weights (weights in float32, the sum in ``dtype``, as HF does)."""
    t, k = routing.experts.shape
    back = all_to_all_v(rows, comm, group, record.recv, record.send)  # (t*k, h) by expert
    slots = back.index_select(0, _inverse(record.order))  # (t*k, h) token-major
    weighted = (slots * routing.weights.reshape(-1, 1)).to(dtype)  # (t*k, h)
    return weighted.view(t, k, -1).sum(dim=1)  # (t, h)


def moe_forward(hidden: Tensor, routing: Routing, num_experts: int, expert: ExpertFn,
                comm: Collectives, group: Group,
                on_counts: Callable[[list[int]], None] | None = None) -> Tensor:
    """The whole expert-parallel MoE step for this rank's tokens: (t, h) -> (t, h).
    ``on_counts`` receives the rows this rank sent to each expert (E ints, already on the host)."""
    received, record = dispatch(hidden, routing, num_experts, comm, group)  # (n, h)
    if on_counts is not None:
        on_counts(record.counts)
    out = run_local_experts(received, record.recv_counts, expert)  # (n, h)
    return combine(out, routing, record, comm, group, hidden.dtype)  # (t, h)
