"""The router's load-balancing loss over the whole data-parallel batch, as HF computes it on one.

Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6), in transformers'
``load_balancing_loss_func``: E * sum_e f_e * P_e, with f_e the share of (token, choice) slots
routed to expert e and P_e the mean router probability of e, both over the real (unmasked)
tokens of every MoE layer. It is a product of two means, so the mean of the ranks' own losses
is not the loss of their joined batch: under data (and expert) parallelism each rank's
``output.aux_loss`` is its own tokens'. ``load_balancing_loss`` sums the counts, probabilities
and token totals over the data-parallel group first, so every rank gets the single-process
value. The probability sum crosses ranks with Megatron's g (all-reduce forward, identity
backward): each rank's gradient is its own tokens' share, and the data-parallel gradient
reduction adds the shares up as it does for every other loss term. Scale it like the rest of a
rank's loss (a rank's part of a global mean): with the usual ``dp * local / global`` weighting
of the language-model loss, add ``dp * coef * aux`` on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels_runtime.comm.autograd import reduce_from_group
from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group


def load_balancing_loss(router_logits: tuple[Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: Tensor | None, comm: Collectives,
                        group: Group) -> Tensor:
    """HF's auxiliary loss of the batch joined over ``group``; ``router_logits`` is the model
    output's tuple of (t, E) logits per MoE layer, ``attention_mask`` this rank's (b, s)."""
    if not router_logits:
        raise ValueError("no router logits: run the model with output_router_logits=True")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)  # (E,)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)  # (E,)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    t = router_logits[0].shape[0]
    mask = (attention_mask.reshape(-1).to(device, torch.float32) if attention_mask is not None
            else torch.ones(t, dtype=torch.float32, device=device))  # (t,)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)  # (t, E)
        _, chosen = torch.topk(p, top_k, dim=-1)  # (t, k)
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probs = probs + (p * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    totals = torch.cat([counts, rows.reshape(1)])  # (E+1,) no gradient flows through these
    comm.all_reduce(totals, group=group)
    probs = reduce_from_group(probs, comm, group)  # (E,) joined; backward: this rank's share
    return (totals[:-1] / totals[-1] * (probs / totals[-1])).sum() * num_experts
