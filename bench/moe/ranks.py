"""The rank side of ``python -m bench moe``: one small Mixtral under ``ep=2`` and ``dp=2``.

Both variants are the same model (same seed, same weights) on the same 2 ranks: under ``dp=2``
every rank holds every expert; under ``ep=2`` (dp=2 carved into one ep group) each holds half
of them and tokens travel to their experts by all-to-all. Counted on the ranks: the
all-to-all bytes of one training step's forward and backward (from the instrumented
``Collectives``' counters), the model-state bytes the optimizer reports, the tokens each expert
got (over both ranks), and step times, the variants interleaved round by round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench.common.timing import time_variants
from bench.moe.formulas import Shape

VARIANTS = ("ep=2", "dp=2")
_COMMS: list = []  # one Collectives per rank process: plans reuse their cached groups


def _comm() -> Any:
    from kernels_runtime.comm import Collectives

    if not _COMMS:
        _COMMS.append(Collectives())
    return _COMMS[0]


def build_model(shape: Shape) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k, vocab_size=shape.vocab,
        max_position_embeddings=shape.seq, initializer_range=0.2))


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters of all experts, and the rest (held whole by every rank under ep)."""
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"experts": experts, "dense": sum(p.numel() for p in model.parameters()) - experts}


def token_batch(shape: Shape, step: int, rank: int) -> torch.Tensor:
    """This rank's (b, s) token ids of a step."""
    seed = step * 1009 + rank
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq),
                         generator=torch.Generator().manual_seed(seed))


class Variant:
    """One plan's model and optimizer; ``step(i)`` trains one step and returns its loss."""

    def __init__(self, shape: Shape, plan: str, comm: Any) -> None:
        from kernels_runtime import ParallelContext, parallelize

        self.shape, self.ctx = shape, ParallelContext.build(plan, comm)
        model = build_model(shape)
        self.model, self.opt = parallelize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx=self.ctx, verbose=False)

    def forward(self, step: int) -> Any:
        ids = token_batch(self.shape, step, self.ctx.dp_rank)
        return self.model(input_ids=ids, labels=ids, output_router_logits=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad()
        self.opt.backward(loss)
        self.opt.finish_grad_sync()

    def step(self, i: int) -> float:
        out = self.forward(i)
        self.backward(out.loss)
        self.opt.step()
        return float(out.loss.detach())


def _all_to_all_bytes(comm: Any) -> int:
    return sum(int(c["bytes"]) for c in comm.stats.snapshot().get("all_to_all", {}).values())


def _tokens_per_expert(out: Any, variant: Variant) -> list[list[int]]:
    """Per MoE layer, the (token, choice) slots each expert got over the data-parallel batch."""
    counts = torch.stack([torch.bincount(logits.topk(variant.shape.top_k).indices.reshape(-1),
                                         minlength=variant.shape.experts)
                          for logits in out.router_logits])  # (layers, E)
    variant.ctx.comm.all_reduce(counts, group=variant.ctx.dp_group)
    return counts.tolist()


def counted(rank: int, world: int, shape: Shape,
            comm_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """One training step per variant: all-to-all bytes of the ep step's forward and backward
    on this rank, each variant's model-state bytes, tokens per expert, parameter counts."""
    comm = (comm_factory or _comm)()
    out: dict[str, Any] = {"params": parameter_counts(build_model(shape))}
    for plan in VARIANTS:
        variant = Variant(shape, plan, comm)
        before = _all_to_all_bytes(comm)
        result = variant.forward(0)
        forward = _all_to_all_bytes(comm)
        variant.backward(result.loss)
        backward = _all_to_all_bytes(comm)
        variant.opt.step()
        out[plan] = {"forward": forward - before, "backward": backward - forward,
                     "state": variant.opt.memory_breakdown(),
                     "tokens": _tokens_per_expert(result, variant)}
    return out


def timed(rank: int, world: int, shape: Shape, rounds: int, steps: int,
          comm_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Step times of both variants, interleaved (``bench.common.timing``), on this rank."""
    comm = (comm_factory or _comm)()
    made = {plan: Variant(shape, plan, comm) for plan in VARIANTS}
    return time_variants(made, rounds, steps)
