"""An HF sparse-MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE) whose experts are split over an ep group.

Why a swap: transformers' sparse-MoE blocks hold all E experts fused in two tensors
(``experts.gate_up_proj`` (E, 2*I, h), gate rows then up rows; ``experts.down_proj`` (E, h, I))
and loop over them on their own tokens. ``ExpertParallelMoE`` keeps this rank's E/ep slices under
the same names, keeps the router module itself (``gate``, so transformers' output recorder still
collects its logits for the auxiliary load-balancing loss, and its own top-k and normalization
give the routing) and runs the dispatch of ``dispatch.py``; a shared expert (Qwen2-MoE) stays
whole on every rank. Which attribute is which comes from the block's ``MoeSpec``
(``kernels_runtime.policies.moe``). Its forward returns what the HF block returns: the hidden
states (b, s, h).

Gradients: the router (and everything outside the MoE blocks) is replicated over ep, each rank
seeing its own tokens, so its gradients are summed over dp x ep; an expert's gradient already
holds every ep rank's tokens (the all-to-all brought them) and is summed over the
expert-data-parallel group only. ``is_expert_parameter`` tells the two apart.

Expert load: each forward hands the rows this rank routed to each expert (the counts dispatch
reads on the host anyway) to the telemetry of its collectives (``ExpertLoad``), under the
block's ``name``; activation checkpointing's replay of the forward in backward is not counted
again (the routing is the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels_runtime.comm.autograd import copy_to_group, reduce_from_group
from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group
from kernels_runtime.parallel.expert.dispatch import Routing, moe_forward
from kernels_runtime.parallel.expert.expert_compute import expert_mlp
from kernels_runtime.parallel.expert.router_stats import StageCarry
from kernels_runtime.policies.moe import MoeSpec, moe_spec

EXPERT_ATTR = "_expert_parallel"  # set on expert parameters: their gradients skip the ep sum


def local_count(total: int, ep: int) -> int:
    """Experts per rank of an ep group (E/ep); a clear error when ep does not divide E."""
    if total % ep:
        divisors = [n for n in range(1, total + 1) if total % n == 0]
        raise ValueError(f"the block has {total} experts, which do not divide over ep={ep} "
                         f"ranks; choose ep in {divisors}")
    return total // ep


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class LocalExperts(nn.Module):
    """This rank's experts [first, first + E/ep) of a Mixtral experts module, as its slices.

    Under tensor parallelism (``tp_group`` of more than one rank) each expert is split as
    Megatron splits an MLP: the gate and up projections by output (column-parallel: this tp
    rank's I/tp rows of each, side by side as HF fuses them), the down projection by input
    (row-parallel). The rows an expert receives are the same on every tp rank (each tp rank
    dispatches the same tokens within its own ep group), so they enter with Megatron's f
    (identity; gradients summed over tp) and the partial outputs leave with g (summed over
    tp), once per layer for all local experts together.

    ``grad_scale`` multiplies the weights' gradients (1 alone; the data step sets 1/ep, see
    ``grad_sync.py``). It is applied to the weights as used in forward, so it holds whatever
    holds the parameters: flat buckets (zero 0-2) or gathered FSDP2 shards (zero 3).

    The experts' matmuls are ``expert_compute.expert_mlp``'s: two grouped GEMMs over all local
    experts on a GPU that runs them, else a loop (``path`` "auto"; "grouped" or "loop" forces)."""

    def __init__(self, experts: nn.Module, rank: int, ep: int, comm: Collectives | None = None,
                 tp_group: Group | None = None) -> None:
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        local = local_count(total, ep)
        self.num_experts, self.first = total, rank * local
        self.comm, self.tp_group = comm, tp_group
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        inter = experts.down_proj.shape[-1]  # I
        if inter % tp:
            raise ValueError(f"tp={tp} does not divide the experts' intermediate size {inter}: "
                             f"each tp rank holds I/tp of every expert's features; choose tp "
                             f"in {[n for n in range(1, inter + 1) if inter % n == 0]}")
        self.inter, self.tp, self.tp_rank = inter, tp, tp_rank
        keep = slice(self.first, self.first + local)
        cols = slice(tp_rank * inter // tp, (tp_rank + 1) * inter // tp)
        gate_up = experts.gate_up_proj.detach()[keep]  # (E/ep, 2I, h)
        gate_up = torch.cat([gate_up[:, :inter][:, cols], gate_up[:, inter:][:, cols]], dim=1)
        # (E/ep, 2I/tp, h) and (E/ep, h, I/tp): copies, so the full tensors can be freed
        self.gate_up_proj = nn.Parameter(gate_up.clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[keep][..., cols].clone())
        for param in (self.gate_up_proj, self.down_proj):
            setattr(param, EXPERT_ATTR, True)
        self.act_fn = experts.act_fn
        self.grad_scale = 1.0
        self.path = "auto"  # expert_compute's choice; "grouped" or "loop" forces one

    def forward(self, chunks: list[Tensor]) -> list[Tensor]:
        """Each local expert on its rows, Mixtral's SwiGLU MLP: [(m_e, h)] -> [(m_e, h)]. Every
        expert runs, on zero rows if none came, so its weights are in the graph every step."""
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj  # (E/ep, 2I/tp, h), (.., I/tp)
        if self.grad_scale != 1.0:
            gate_up_proj = _ScaleGrad.apply(gate_up_proj, self.grad_scale)
            down_proj = _ScaleGrad.apply(down_proj, self.grad_scale)
        sizes = [rows.shape[0] for rows in chunks]
        rows = torch.cat(chunks)  # (n, h) sorted by local expert
        if self.tp > 1:  # f: one all-reduce of the rows' gradients in backward
            rows = copy_to_group(rows, self.comm, self.tp_group)
        # grouped GEMMs on a GPU, else a loop (``expert_compute.py``)
        out = expert_mlp(rows, sizes, gate_up_proj, down_proj, self.act_fn, self.path)  # (n, h)
        if self.tp > 1:  # g: this rank's partial sums, added over tp
            out = reduce_from_group(out, self.comm, self.tp_group)
        return list(out.split(sizes))


def _spec_of(block: nn.Module) -> MoeSpec:
    spec = moe_spec(block)
    if spec is None:
        raise TypeError(f"ExpertParallelMoE takes a transformers Mixtral-style sparse MoE block "
                        f"(a gate router and fused experts.gate_up_proj / down_proj / act_fn); "
                        f"{type(block).__name__} is not one. Pass model.model.layers[i].mlp of "
                        "a Mixtral, Qwen2-MoE or Qwen3-MoE model")
    return spec


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a forward run then is activation
    checkpointing's replay, whose routing the forward already counted."""
    return torch._C._current_graph_task_id() != -1


class ExpertParallelMoE(nn.Module):
    """``block``'s router (and shared expert), replicated, and this rank's share of its experts
    over ``group``, each expert split over ``tp_group`` when given (``LocalExperts``; the shared
    expert is then the tensor applier's column/row-parallel MLP). Under pp, ``carry`` collects
    its router's sums for the stage-spanning auxiliary loss. ``name`` labels its row of the
    expert load (the applier passes the block's module path)."""

    def __init__(self, block: nn.Module, comm: Collectives, group: Group,
                 spec: MoeSpec | None = None, name: str = "moe",
                 tp_group: Group | None = None, carry: StageCarry | None = None) -> None:
        super().__init__()
        spec = spec if spec is not None else _spec_of(block)
        self.comm, self.group, self.name = comm, group, name
        self.carry = carry  # under pp: the router sums stages pass on (``router_stats.py``)
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        self.gate = getattr(block, spec.router)
        self.top_k = getattr(block, "top_k", getattr(self.gate, "top_k", None))
        self.experts = LocalExperts(getattr(block, spec.experts), dist.get_rank(group),
                                    dist.get_world_size(group), comm, tp_group)
        self.shared_expert = getattr(block, spec.shared_expert) if spec.shared_expert else None
        self.shared_expert_gate = getattr(block, spec.shared_gate) if spec.shared_gate else None

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, seq, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # HF's jitter, without its in-place write
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, hidden)  # (t, h)
        # through the module so HF records the logits; its own top-k and normalization
        logits, weights, experts = self.gate(flat)  # (t, E), (t, k), (t, k)
        if self.carry is not None and not _in_backward():  # once, not in a checkpoint's replay
            self.carry.add_layer(logits)
        out = moe_forward(flat, Routing(experts=experts, weights=weights),
                          self.experts.num_experts, self.experts, self.comm, self.group,
                          self._record_load)  # (t, h)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)  # (t, h)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(batch, seq, hidden)

    def _record_load(self, counts: list[int]) -> None:
        """This forward's rows per expert into the rank's telemetry (none outside a session's
        collectives; a checkpointed block's replay in backward is skipped)."""
        load = getattr(getattr(self.comm, "telemetry", None), "expert_load", None)
        if load is not None and not _in_backward():
            load.record(self.name, counts)


def is_expert_parameter(param: Tensor) -> bool:
    """True for a parameter held by one rank of the ep group (reduce over expert-dp only)."""
    return getattr(param, EXPERT_ATTR, False)
