"""The router's load-balancing loss under pipeline parallelism: its sums carried between stages.

HF's auxiliary loss (``aux_loss.py``) is E * sum_e f_e * P_e over the router logits of every
MoE layer of one forward: f_e and P_e are sums over all layers divided by all layers' rows, so
the loss is a product of two sums over layers, not a sum of per-layer terms, and no stage can
compute a part of it alone. The way chosen here: each stage adds its own layers' three sums to
the ones the previous stage sent, and passes them on packed behind the activation, in the one
tensor stages exchange (``StageCarry``):

    [hidden (b*s*h) | probability per expert (E) | rows routed to each expert (E) | rows (1)]

so the last stage holds the sums over every layer and computes the loss there
(``stage_aux_loss``), joined over dp as ``load_balancing_loss`` does. The probabilities keep
their graph: the loss's gradient with respect to an earlier stage's probabilities comes back in
the activation's gradient like any other, and reaches that stage's routers and everything
before them. The counts and row totals carry no gradient (zeros come back for them). The loss
is per micro-batch, as HF computes it per forward call.

Rejected: an all-reduce of the counts over pp (a collective in the middle of the schedule's
point-to-point order, reached by the stages at different times), and Megatron's per-layer
auxiliary loss added to the activation's gradient (a different loss from HF's).

Precision: the sums travel in the activation's dtype; under bf16 a count above 256 rounds (the
loss is then as approximate as the rest of a bf16 step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kernels_runtime.comm.autograd import reduce_from_group
from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group


class StageCarry:
    """This rank's router sums for the forward running now, and their packing between stages.

    ``begin`` (a forward pre-hook on the whole model) starts a forward's sums from zero and
    keeps its attention mask; each ``ExpertParallelMoE`` adds its router logits; a stage
    ``pack``s its sums behind its output and the next one ``unpack``s them before its first
    block (``pipeline/stage.py`` calls both)."""

    def __init__(self, num_experts: int, top_k: int, comm: Collectives, dp_group: Group) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.comm, self.dp_group = comm, dp_group
        self.mask: Tensor | None = None  # (b, s) of the running forward, or None: every token
        self.probs = self.counts = self.rows = torch.zeros(())

    def begin(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the model (with kwargs): a new forward, sums from zero."""
        self.mask = kwargs.get("attention_mask")
        self.probs = torch.zeros(self.num_experts)  # (E,)
        self.counts = torch.zeros(self.num_experts)  # (E,)
        self.rows = torch.zeros(())

    def contribution(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One layer's (probs (E,), counts (E,), rows ()) from its router logits (t, E), over
        the real tokens only."""
        t = logits.shape[0]
        mask = (self.mask.reshape(-1).to(logits.device, torch.float32)
                if self.mask is not None else torch.ones(t, device=logits.device))  # (t,)
        p = torch.softmax(logits.float(), dim=-1)  # (t, E)
        _, chosen = torch.topk(p, self.top_k, dim=-1)  # (t, k)
        counts = torch.zeros(self.num_experts, device=logits.device).scatter_add(
            0, chosen.reshape(-1), mask.repeat_interleave(self.top_k))  # (E,)
        return (p * mask.unsqueeze(-1)).sum(dim=0), counts, mask.sum()

    def add_layer(self, logits: Tensor) -> None:
        """Add one layer's sums (``contribution``). Its tensors are saved for backward as
        they are, even inside a checkpointed block: a checkpoint's replay in backward runs
        under another micro-batch's ``mask`` (the pipeline interleaves them), so these few
        (t, E) tensors must not be recomputed there (the replay skips this call)."""
        with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            self.add(self.contribution(logits))

    def add(self, part: tuple[Tensor, Tensor, Tensor]) -> None:
        probs, counts, rows = part
        self.probs = self.probs.to(probs.device) + probs
        self.counts = self.counts.to(counts.device) + counts.detach()
        self.rows = self.rows.to(rows.device) + rows.detach()

    def pack(self, hidden: Tensor) -> Tensor:
        """A stage's output: its activation (b, s, h) flat, then its sums (2E + 1)."""
        sums = torch.cat([self.probs, self.counts, self.rows.reshape(1)]).to(hidden.dtype)
        return torch.cat([hidden.reshape(-1), sums])  # (b*s*h + 2E + 1,)

    def unpack(self, incoming: Tensor, like: Tensor) -> Tensor:
        """The previous stage's sums become this forward's start; returns the activation,
        shaped as ``like`` (the placeholder the first block was called with)."""
        n, e = like.numel(), self.num_experts
        if incoming.dim() != 1 or incoming.numel() != n + 2 * e + 1:
            raise RuntimeError(f"a pipeline stage received {tuple(incoming.shape)}, not an "
                               f"activation of {n} values followed by {2 * e + 1} router sums; "
                               "every stage of an expert-parallel pipeline must carry them")
        self.probs = incoming[n:n + e].float()  # keeps the graph back to the sender
        self.counts = incoming[n + e:n + 2 * e].detach().float()
        self.rows = incoming[-1].detach().float()
        return incoming[:n].view(like.shape)  # (b, s, h)

    def loss(self) -> Tensor:
        """HF's auxiliary loss of this forward over every layer and every dp rank's tokens
        (on the last stage, where the sums hold every layer)."""
        totals = torch.cat([self.counts, self.rows.reshape(1)])  # (E+1,) no gradient
        self.comm.all_reduce(totals, group=self.dp_group)
        probs = reduce_from_group(self.probs, self.comm, self.dp_group)  # (E,) joined
        rows = totals[-1]
        return (totals[:-1] / rows * (probs / rows)).sum() * self.num_experts


def _kept(tensor: Tensor) -> Tensor:
    return tensor


def stage_aux_loss(model: nn.Module) -> Tensor:
    """The router's load-balancing loss of the forward that just ran, as HF computes it over
    every layer of the model and the batch joined over dp: call it in a pipelined objective's
    loss (it runs on the last stage). Scale it as ``load_balancing_loss``'s."""
    state = model.__dict__.get("parallel_state")
    carry = getattr(state, "stage_carry", None)
    if carry is None:
        raise ValueError("stage_aux_loss is for a model parallelized with ep > 1 and pp > 1; "
                         "otherwise compute load_balancing_loss(output.router_logits, ...)")
    return carry.loss()
