"""A module-list MoE block (router ``nn.Linear`` + ``nn.ModuleList`` of experts) split over ep.

Why not fuse the experts into ``LocalExperts``' 3-D slices: one fused tensor would stand for
many user parameters, which neither the user's optimizer (built over the E * 3 expert weights)
nor checkpoint names (``experts.2.w1.weight``) can follow. Here each rank keeps its E/ep expert
modules themselves, the very parameter objects, under their global indices
(``ModuleListLocalExperts``: a child "2" on the rank holding experts 2 and 3), so every name is
the plain model's; a parameter's layout is its whole tensor, held by the ranks of one ep place
("dp" sharded, expert-dp replicas), and the other ranks' experts are names held elsewhere, as a
pipeline stage's are. The block's reading (router, top-k, normalization, shared expert, whether
it returns its router logits) is the policy's data (``policies/moe_modulelist.py``); dispatch,
grad sync, ZeRO 1-3 and checkpoints are those of the fused case (``LocalExperts`` is the unit
they look for). Not composed yet (the applier refuses them): tp, whose generic policy would
split the experts' own linears, and pp.

Gradient scale: the data step scales expert gradients by 1/ep (``grad_sync.py``). Each expert
runs its own forward here, so the scale goes around it instead of onto its weights: the rows
enter with their gradient times ep and the output leaves with its gradient times 1/ep, which
leaves the input gradient as it was and scales every weight's by 1/ep, whatever holds them
(flat buckets or FSDP2's gathered shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.expert.dispatch import Routing, moe_forward
from kernels_runtime.parallel.expert.moe_layer import (
    EXPERT_ATTR,
    LocalExperts,
    _in_backward,
    _ScaleGrad,
    local_count,
)
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.policies.moe_modulelist import ModuleListReading, route_topk


class ModuleListLocalExperts(LocalExperts):
    """This rank's experts [first, first + E/ep) of a ModuleList, the modules themselves, as
    children named by their global index. A ``LocalExperts`` to the data step (its grad scale,
    ZeRO-3 unit and layouts) but not its fused storage: hence no ``LocalExperts.__init__``."""

    def __init__(self, experts: nn.ModuleList, rank: int, ep: int, inter: int) -> None:
        nn.Module.__init__(self)
        total = len(experts)
        local = local_count(total, ep)
        self.num_experts, self.first = total, rank * local
        self.comm, self.tp_group, self.tp, self.tp_rank, self.inter = None, None, 1, 0, inter
        for index in range(self.first, self.first + local):
            self.add_module(str(index), experts[index])
        for param in self.parameters():
            setattr(param, EXPERT_ATTR, True)
        self.grad_scale = 1.0
        self.path = "loop"  # each expert's own forward (no grouped GEMM over user modules)

    def forward(self, chunks: list[Tensor]) -> list[Tensor]:
        """Each local expert's own forward on its rows: [(m_e, h)] -> [(m_e, h)]; every expert
        runs, on zero rows if none came, so its weights are in the graph every step."""
        out = []
        for expert, rows in zip(self.children(), chunks):
            if self.grad_scale != 1.0:  # weights' gradients times grad_scale, inputs' unchanged
                rows = _ScaleGrad.apply(rows, 1.0 / self.grad_scale)
            y = expert(rows)  # (m, h)
            out.append(_ScaleGrad.apply(y, self.grad_scale) if self.grad_scale != 1.0 else y)
        return out

    def slice_layouts(self) -> dict[str, ParamLayout]:
        """Each parameter is its whole global tensor, held by this rank's ep place only."""
        return {name: ParamLayout.box(tuple(p.shape), (0,) * p.dim(), tuple(p.shape),
                                      frozenset({"dp"})) for name, p in self.named_parameters()}


class ModuleListExpertParallelMoE(nn.Module):
    """``block``'s router (and shared expert), replicated, and this rank's experts over
    ``group``, under the block's own attribute names; returns what the block returned (the
    hidden states, or with the router logits (t, E) beside them)."""

    def __init__(self, block: nn.Module, reading: ModuleListReading, comm: Collectives,
                 group: Group, name: str = "moe") -> None:
        super().__init__()
        self.reading, self.comm, self.group, self.name = reading, comm, group, name
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        setattr(self, reading.router, getattr(block, reading.router))
        local = ModuleListLocalExperts(getattr(block, reading.experts), dist.get_rank(group),
                                       dist.get_world_size(group), reading.inter)
        setattr(self, reading.experts, local)
        for part in (reading.shared_expert, reading.shared_gate):
            if part is not None:
                setattr(self, part, getattr(block, part))

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        reading = self.reading
        if self.training and self.jitter_noise > 0:  # transformers 4 Mixtral's jitter
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, reading.hidden)  # (t, h)
        logits = getattr(self, reading.router)(flat)  # (t, E)
        weights, experts = route_topk(logits, reading.top_k, reading.normalize)  # (t, k) each
        local = getattr(self, reading.experts)
        out = moe_forward(flat, Routing(experts=experts, weights=weights), reading.num_experts,
                          local, self.comm, self.group, self._record_load)  # (t, h)
        if reading.shared_expert is not None:
            shared = getattr(self, reading.shared_expert)(flat)  # (t, h)
            if reading.shared_gate is not None:
                shared = torch.sigmoid(getattr(self, reading.shared_gate)(flat)) * shared
            out = out + shared
        out = out.reshape(hidden_states.shape)
        return (out, logits) if reading.returns_logits else out

    def _record_load(self, counts: list[int]) -> None:
        """This forward's rows per expert into the rank's telemetry (as ``ExpertParallelMoE``)."""
        load = getattr(getattr(self.comm, "telemetry", None), "expert_load", None)
        if load is not None and not _in_backward():
            load.record(self.name, counts)


def swap_modulelist_block(model: nn.Module, path: str, block: nn.Module,
                          reading: ModuleListReading, state: ParallelState) -> None:
    """Swap ``block`` at ``path`` for its ep share and keep the books: the other ranks' expert
    parameters leave the user's optimizer and count as held elsewhere (a checkpoint of the
    whole model then loads), this rank's are recorded as themselves in ``replaced_params`` so
    ZeRO-3 can map them to its shards."""
    ctx = state.ctx
    names_before = {n for n, _ in block.named_parameters()}
    swapped = ModuleListExpertParallelMoE(block, reading, ctx.comm, ctx.group("ep"), name=path)
    kept = {id(p) for p in swapped.parameters()}
    dropped = {id(p) for p in block.parameters()} - kept
    prefix = f"{path}." if path else ""
    state.elsewhere |= {prefix + n for n in names_before - set(
        dict(swapped.named_parameters()))}
    for param in getattr(swapped, reading.experts).parameters():
        state.replaced_params.setdefault(id(param), param)
    if state.optimizer is not None:
        for group in state.optimizer.param_groups:
            group["params"] = [p for p in group["params"]
                               if id(state.replaced_params.get(id(p), p)) not in dropped]
    model.set_submodule(path, swapped)
    local = getattr(swapped, reading.experts)
    state.replaced.append((path, f"{type(block).__name__} -> ModuleListExpertParallelMoE "
                                 f"({reading.num_experts // ctx.plan.ep} of "
                                 f"{reading.num_experts} experts: {local.first}.."
                                 f"{local.first + reading.num_experts // ctx.plan.ep - 1})"))
