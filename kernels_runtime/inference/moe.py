"""Mixture-of-experts blocks as the engine serves them: experts split over ep and tp ranks.

Why not training's all-to-all (``parallel/expert/dispatch.py``): there each ep rank brings its
own tokens, so rows must travel to their experts' ranks and back, two variable-split exchanges
per layer whose sizes are known only after routing. An engine replica is one scheduler whose
every rank runs the same step (as tp ranks do), so every rank of an ep group already holds all
of the step's tokens. Each rank then runs the router itself (replicated, the same routing
everywhere), computes its own experts on the rows routed to them and the partial outputs are
summed with one all-reduce of (T, h) per layer, the formulation of row-parallel layers. For
decoding, where T is a handful of tokens, one fixed-size all-reduce costs less than a count
exchange plus two all-to-alls, and nothing depends on which expert got a token: a rank whose
experts get no row still joins the all-reduce with zeros, so no rank waits on a skipped
collective.

Tensor parallelism over experts (Megatron's MLP split applied to each expert): every rank of a
tp group holds a slice of each expert's intermediate features, gate and up rows column-split
and down columns row-split, so its output is a partial sum reduced over tp. Under both, a rank
holds E/ep experts, each with I/tp features, and sums over tp then over ep.

Against HF's block: routing is HF's own router module, so every rank picks the same experts
with the same weights as HF; each expert is HF's SwiGLU on its rows (this rank's experts
in two grouped GEMMs on a GPU, as training's ``expert_compute.py`` runs them, a loop elsewhere;
one host read per layer, the count of this rank's rows); the outputs differ from HF's only by
float rounding (HF's grouped matmuls and summation order; tp also splits the down projection's
inner sum): about 1e-7 relative in fp32. A shared expert (Qwen2-MoE) runs whole
on every rank (tp splits it as a dense MLP) after the sum, as HF adds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.parallel.expert.expert_compute import expert_mlp
from kernels_runtime.policies.moe import MoeSpec, expert_count, moe_blocks


@dataclass(frozen=True)
class ExpertSplit:
    """How this rank's experts are cut: ``ep`` ranks split the experts (this one holds
    [first, first + E/ep)), ``tp`` ranks split each expert's intermediate features (this one
    holds features [tp_rank * I/tp, (tp_rank + 1) * I/tp))."""

    ep: int = 1
    ep_rank: int = 0
    tp: int = 1
    tp_rank: int = 0


def expert_slices(experts: nn.Module, split: ExpertSplit) -> tuple[Tensor, Tensor]:
    """This rank's part of fused HF experts: gate_up (E/ep, 2I/tp, h), gate rows then up rows
    as HF stores them; down (E/ep, h, I/tp). Copies, so the full tensors can be freed."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # (E,2I,h) (E,h,I)
    total, inter = gate_up.shape[0], gate_up.shape[1] // 2
    local, width = total // split.ep, inter // split.tp
    keep = slice(split.ep_rank * local, (split.ep_rank + 1) * local)
    cols = slice(split.tp_rank * width, (split.tp_rank + 1) * width)
    gate = gate_up[keep, :inter][:, cols]  # (E/ep, I/tp, h)
    up = gate_up[keep, inter:][:, cols]  # (E/ep, I/tp, h)
    return (torch.cat([gate, up], dim=1).clone(),  # (E/ep, 2I/tp, h)
            down[keep][:, :, cols].clone())  # (E/ep, h, I/tp)


class ServedExperts(nn.Module):
    """A sparse-MoE block for the engine: the router (and shared expert) as the block had
    them, this rank's expert slices (``split``), and the all-reduces that sum the ranks'
    partial outputs (``groups``: tp's, then ep's; empty on one rank)."""

    def __init__(self, block: nn.Module, spec: MoeSpec, split: ExpertSplit, comm: Collectives,
                 groups: list[dist.ProcessGroup]) -> None:
        super().__init__()
        experts = getattr(block, spec.experts)
        self.num_experts = expert_count(block, spec)
        self.first = split.ep_rank * (self.num_experts // split.ep)
        self.gate = getattr(block, spec.router)  # HF's router: its own top-k and normalization
        gate_up, down = expert_slices(experts, split)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)  # (E/ep, 2I/tp, h)
        self.down_proj = nn.Parameter(down, requires_grad=False)  # (E/ep, h, I/tp)
        self.act_fn = experts.act_fn
        self.path = "auto"  # expert_compute's choice; "grouped" or "loop" forces one
        self.shared_expert = getattr(block, spec.shared_expert) if spec.shared_expert else None
        self.shared_expert_gate = getattr(block, spec.shared_gate) if spec.shared_gate else None
        self.comm, self.groups = comm, groups

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden)  # (t, h): every token of the step, every rank
        _, weights, chosen = self.gate(flat)  # (t, k) routing weights, (t, k) expert ids
        out = torch.zeros_like(flat)  # (t, h) this rank's partial sum
        local = self.gate_up_proj.shape[0]
        expert = chosen.reshape(-1) - self.first  # (t*k,) each slot's local expert
        mine = (expert >= 0) & (expert < local)  # (t*k,)
        order = torch.argsort(torch.where(mine, expert, local), stable=True)  # (t*k,) mine first
        n = int(mine.sum())  # the one host read of the layer
        if n:  # no collective inside: the all-reduce below runs on every rank
            slots = order[:n]  # (n,) this rank's slots sorted by expert
            token = slots // chosen.shape[-1]  # (n,)
            sizes = torch.bincount(expert[slots], minlength=local)  # (E/ep,) on the device
            # grouped GEMMs on a GPU, else a loop (``parallel/expert/expert_compute.py``)
            y = expert_mlp(flat[token], sizes, self.gate_up_proj, self.down_proj, self.act_fn,
                           self.path)  # (n, h)
            y = y * weights.reshape(-1)[slots, None]
            out.index_add_(0, token, y.to(out.dtype))
        for group in self.groups:
            self.comm.all_reduce(out, group=group)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)  # (t, h), whole (tp reduced it inside)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(batch, seq, hidden)


def serve_experts(model: nn.Module, split: ExpertSplit, comm: Collectives,
                  groups: list[dist.ProcessGroup]) -> list[tuple[str, str]]:
    """Swap every sparse-MoE block of ``model`` for a ``ServedExperts`` holding this rank's
    part; (path, what it became) of each, for the parallelize table."""
    swapped = []
    for path, block, spec in moe_blocks(model):
        served = ServedExperts(block, spec, split, comm, groups)
        model.set_submodule(path, served)
        local = served.gate_up_proj.shape
        swapped.append((path, f"{type(block).__name__} -> ServedExperts ({local[0]} of "
                              f"{served.num_experts} experts, {local[1] // 2} features each)"))
    return swapped
