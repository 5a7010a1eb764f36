"""An HF Mixtral sparse-MoE block whose experts are split over the ranks of an ep group.

Why a swap: transformers' ``MixtralSparseMoeBlock`` holds all E experts fused in two tensors
(``experts.gate_up_proj`` (E, 2*I, h), gate rows then up rows; ``experts.down_proj`` (E, h, I))
and loops over them on its own tokens. ``ExpertParallelMoE`` keeps this rank's E/ep slices under
the same names, keeps the router module itself (``gate``, so transformers' output recorder still
collects its logits for the auxiliary load-balancing loss) and runs the dispatch of
``dispatch.py``. Its forward returns what the HF block returns: the hidden states (b, s, h).

Gradients: the router (and everything outside the MoE blocks) is replicated over ep, each rank
seeing its own tokens, so its gradients are summed over dp x ep; an expert's gradient already
holds every ep rank's tokens (the all-to-all brought them) and is summed over the
expert-data-parallel group only. ``is_expert_parameter`` tells the two apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group
from kernels_runtime.parallel.expert.dispatch import moe_forward, route

EXPERT_ATTR = "_expert_parallel"  # set on expert parameters: their gradients skip the ep sum


class LocalExperts(nn.Module):
    """This rank's experts [first, first + E/ep) of a Mixtral experts module, as its slices."""

    def __init__(self, experts: nn.Module, rank: int, ep: int) -> None:
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        if total % ep:
            divisors = [n for n in range(1, total + 1) if total % n == 0]
            raise ValueError(f"the block has {total} experts, which do not divide over ep={ep} "
                             f"ranks; choose ep in {divisors}")
        local = total // ep
        self.num_experts, self.first = total, rank * local
        keep = slice(self.first, self.first + local)
        # (E/ep, 2I, h) and (E/ep, h, I): copies, so the full tensors can be freed
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[keep].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[keep].clone())
        for param in (self.gate_up_proj, self.down_proj):
            setattr(param, EXPERT_ATTR, True)
        self.act_fn = experts.act_fn

    def forward(self, index: int, rows: Tensor) -> Tensor:
        """Local expert ``index`` on its rows: (m, h) -> (m, h), Mixtral's SwiGLU MLP."""
        gate, up = nn.functional.linear(rows, self.gate_up_proj[index]).chunk(2, dim=-1)  # (m, I)
        return nn.functional.linear(self.act_fn(gate) * up, self.down_proj[index])  # (m, h)


def _check_block(block: nn.Module) -> None:
    missing = [name for name, ok in [
        ("gate.weight", hasattr(getattr(block, "gate", None), "weight")),
        ("top_k", hasattr(block, "top_k")),
        ("experts.gate_up_proj", hasattr(getattr(block, "experts", None), "gate_up_proj")),
        ("experts.down_proj", hasattr(getattr(block, "experts", None), "down_proj")),
        ("experts.act_fn", hasattr(getattr(block, "experts", None), "act_fn")),
    ] if not ok]
    if missing:
        raise TypeError(f"ExpertParallelMoE takes a transformers Mixtral-style sparse MoE block "
                        f"(fused experts.gate_up_proj / down_proj); {type(block).__name__} has no "
                        f"{', '.join(missing)}. Pass model.model.layers[i].mlp of a Mixtral model")


class ExpertParallelMoE(nn.Module):
    """``block``'s router, replicated, and this rank's share of its experts over ``group``."""

    def __init__(self, block: nn.Module, comm: Collectives, group: Group) -> None:
        super().__init__()
        _check_block(block)
        self.comm, self.group = comm, group
        self.top_k = block.top_k
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        self.gate = block.gate
        self.experts = LocalExperts(block.experts, dist.get_rank(group),
                                    dist.get_world_size(group))

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, seq, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # HF's jitter, without its in-place write
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, hidden)  # (t, h)
        logits = self.gate(flat)[0]  # (t, E); through the module so HF records the logits
        out = moe_forward(flat, route(logits, self.top_k), self.experts.num_experts,
                          self.experts, self.comm, self.group)  # (t, h)
        return out.reshape(batch, seq, hidden)


def is_expert_parameter(param: Tensor) -> bool:
    """True for a parameter held by one rank of the ep group (reduce over expert-dp only)."""
    return getattr(param, EXPERT_ATTR, False)
