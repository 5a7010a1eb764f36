"""The router's load-balancing loss under pipeline parallelism: its sums carried between stages.

HF's auxiliary loss (``aux_loss.py``) is E * sum_e f_e * P_e over the router logits of every
MoE layer of one forward: f_e and P_e are sums over all layers divided by all layers' rows, so
the loss is a product of two sums over layers, not a sum of per-layer terms, and no stage can
compute a part of it alone. The way chosen here: each stage adds its own layers' three sums to
the ones the previous stage sent, and passes them on packed behind the activation, in the one
tensor stages exchange (``StageCarry``):

    [hidden (b*s*h) | probabilities (E) | exact sums: probabilities (E), rows routed to each
     expert (E), rows (1), as float32 bytes (4 * (2E + 1) bytes in activation-dtype elements)]

so the last stage holds the sums over every layer and computes the loss there
(``stage_aux_loss``), joined over dp as ``load_balancing_loss`` does. The probabilities keep
their graph: the loss's gradient with respect to an earlier stage's probabilities comes back in
the activation's gradient like any other, and reaches that stage's routers and everything
before them (through the probabilities in the activation's dtype: the receiver takes the
exact sums' value and that slot's gradient path). The counts and row totals carry no gradient
(zeros come back for them). The loss is per micro-batch, as HF computes it per forward call.

Rejected: an all-reduce of the counts over pp (a collective in the middle of the schedule's
point-to-point order, reached by the stages at different times), and Megatron's per-layer
auxiliary loss added to the activation's gradient (a different loss from HF's).

Precision: the sums travel exactly, whatever the activation's dtype: their float32 bits are
reinterpreted as that dtype's elements, a copy that no arithmetic touches (point-to-point sends
move bytes). Cast to bf16 instead, a count above 256 would round (spacing 2 up to 512, 4 up to
1024...) and a probability sum lose all but 8 bits, so a bf16 run's auxiliary loss would differ
from the one computed from the same router logits by about 1e-3. Counts stay exact in float32
up to 2^24 rows per expert per forward.
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

    def _exact_width(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` that hold the 2E + 1 float32 sums' bytes."""
        return -(-4 * (2 * self.num_experts + 1) // dtype.itemsize)

    def pack(self, hidden: Tensor) -> Tensor:
        """A stage's output: its activation (b, s, h) flat, its probability sums in its dtype
        (E, the gradient's way back), then every sum's float32 bytes (exact)."""
        device, dtype = hidden.device, hidden.dtype
        exact = torch.cat([self.probs.detach().to(device), self.counts.to(device),
                           self.rows.reshape(1).to(device)]).float()  # (2E+1,)
        raw = exact.view(torch.uint8)  # (4(2E+1),) its bits
        raw = torch.cat([raw, raw.new_zeros(self._exact_width(dtype) * dtype.itemsize
                                            - raw.numel())])  # padded to whole elements
        return torch.cat([hidden.reshape(-1), self.probs.to(device, dtype),
                          raw.view(dtype)])  # (b*s*h + E + width,)

    def unpack(self, incoming: Tensor, like: Tensor) -> Tensor:
        """The previous stage's sums become this forward's start; returns the activation,
        shaped as ``like`` (the placeholder the first block was called with)."""
        n, e = like.numel(), self.num_experts
        width = self._exact_width(incoming.dtype)
        if incoming.dim() != 1 or incoming.numel() != n + e + width:
            raise RuntimeError(f"a pipeline stage received {tuple(incoming.shape)}, not an "
                               f"activation of {n} values followed by {e + width} values of "
                               "router sums; every stage of an expert-parallel pipeline must "
                               "carry them")
        carried = incoming[n:n + e].float()  # (E,) rounded, but the graph back to the sender
        raw = incoming[n + e:].detach().clone().view(torch.uint8)  # clone: offset 0, aligned
        exact = raw[:4 * (2 * e + 1)].view(torch.float32)  # (2E+1,) the sender's bits
        # the exact value, the gradient through ``carried`` less its mean: each token's
        # probabilities sum to 1, so the mean is lost in the routers' softmax anyway, and it is
        # most of the loss's gradient (about the same for every expert); sent without it, the
        # part that matters keeps its precision in a bf16 gradient (measured 7e-2 -> 2e-3)
        centered = carried - carried.mean()  # (E,)
        self.probs = exact[:e] + (centered - centered.detach())  # (E,)
        self.counts, self.rows = exact[e:2 * e], exact[-1]
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
