"""A real expert-parallel run whose published telemetry carries expert load, shared by the
runtime test (the counts are right) and the dashboard test (the heatmap shows them).

On 2 gloo ranks, ``ep=2`` with activation checkpointing (so the backward's replay of each MoE
block runs the routing a second time, which must not be counted): a tiny Mixtral (4 experts,
top-2, 2 layers) trains two steps of 2 micro-batches each, an ``eval_step`` between them, at
learning rate 0 so the weights stay those of the single-process reference. Each rank returns
every snapshot it published and, recomputed in its own process from the reference model's
router logits (top-2 of the same logits), the tokens per expert of its share of the last step.
The run happens once per test session (``ep2_expert_load``), however many tests read it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

BATCH, SEQ, HIDDEN, VOCAB, EXPERTS, TOP_K, LAYERS = 4, 8, 32, 64, 4, 2, 2
PLAN = "ep=2 ckpt"
_RUNS: dict[str, list[dict[str, Any]]] = {}


def tiny_mixtral() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, vocab_size=VOCAB, max_position_embeddings=SEQ,
        initializer_range=0.2, use_cache=False))  # no KV cache to drop under checkpointing


def _microbatches(seed: int) -> list[dict[str, torch.Tensor]]:
    """Two global micro-batches of (BATCH, SEQ) token ids, labels = inputs."""
    out = []
    for i in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ),
                            generator=torch.Generator().manual_seed(100 * seed + i))
        out.append({"input_ids": ids, "labels": ids})
    return out


def reference_counts(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]
                     ) -> list[list[int]]:
    """(layers, experts) tokens per expert of ``batches`` in one plain process: top-k of the
    model's router logits, summed over the micro-batches."""
    total = torch.zeros(LAYERS, EXPERTS, dtype=torch.long)
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], output_router_logits=True).router_logits
            for layer, per_token in enumerate(logits):  # (b*s, E)
                picked = per_token.topk(TOP_K, dim=-1).indices.reshape(-1)  # (b*s*k,)
                total[layer] += torch.bincount(picked, minlength=EXPERTS)
    return total.tolist()


def _on_rank(rank: int, world: int) -> dict[str, Any]:
    from kernels_runtime import eval_step, parallelize, train_step

    from helpers.distributed import context

    ctx = context(PLAN)
    share = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)

    def mine(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return [{k: v[share] for k, v in b.items()} for b in batches]

    model = tiny_mixtral()
    reference = copy.deepcopy(model)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.0), ctx=ctx,
                             verbose=False)
    telemetry = opt.ctx.telemetry
    sent: list[dict[str, Any]] = []
    telemetry.new_cell()  # the pool's ranks are shared: start this test's "cell"
    telemetry.publisher.min_interval_s = 0.0  # every step publishes
    telemetry.set_publisher(sent.append)
    try:
        train_step(model, opt, mine(_microbatches(1)))
        eval_step(model, mine(_microbatches(2)))  # routed, but part of no step
        train_step(model, opt, mine(_microbatches(3)))
        telemetry.flush()
    finally:
        telemetry.set_publisher(None)
        telemetry.publisher.min_interval_s = 0.25
        telemetry.new_cell()  # leave no expert load for the next test on these ranks
    return {"published": sent, "expected": reference_counts(reference, mine(_microbatches(3))),
            "first": reference_counts(reference, mine(_microbatches(1))),
            "tokens": 2 * (BATCH // ctx.dp_size) * SEQ}


def ep2_expert_load(ranks: Callable[[int], Any]) -> list[dict[str, Any]]:
    """Each rank's published snapshots and reference counts (module docstring), run once."""
    if PLAN not in _RUNS:
        _RUNS[PLAN] = ranks(2).run(_on_rank, timeout_s=180)
    return _RUNS[PLAN]
