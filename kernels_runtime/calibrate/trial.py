"""Measure a plan for real: a few training steps of a model built from its shape, on the ranks.

The plan tuner's "Measure" button and ``python -m bench planner`` both need what a prediction
is checked against: step time and peak memory of an actual run of the plan. A trial builds the
model from the same shape description the cost model reads (random weights, a Hugging Face
GPT-2 or LLaMA-family model, a Mixtral for a mixture of experts), parallelizes it with the
plan, runs warm-up and timed steps on random tokens, and measures memory the way a CPU can
(module docstring of ``bench.planner.run``): model states from
``BoostedOptimizer.memory_breakdown()`` plus the bytes autograd keeps for backward during one
micro-batch. Collective: every rank of the default group calls it.

Under pipeline parallelism every rank of a data-parallel replica gets the same micro-batches
(``train_step`` runs the plan's schedule on them and returns the loss on every stage), and a
stage's activations are those of all micro-batches it holds at once: the peak of what autograd
keeps during one whole schedule (``pipeline_memory.peak_live_bytes``), per rank.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch import nn

from kernels_runtime.mesh.plan import Plan

_LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def build_model(shape: dict[str, Any], seed: int = 0) -> nn.Module:
    """An HF causal LM with random weights from a shape dict (the planner's ``ModelSpec``
    fields: hidden, layers, heads, vocab, seq, ffn, kv_heads, positions, model_type,
    activation, attention). Dropout is off so repeated steps do the same work."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # the cost model's attention memory: None is the textbook count (scores materialized)
    attn = "sdpa" if shape.get("attention") in ("sdpa", "flash") else "eager"
    kind = str(shape.get("model_type") or "gpt2").lower()
    hidden, heads = int(shape["hidden"]), int(shape["heads"])
    ffn = shape.get("ffn")
    if kind in ("gpt", "gpt2"):
        cfg = GPT2Config(vocab_size=shape["vocab"], n_positions=max(shape.get("positions") or 0,
                                                                   shape["seq"]),
                         n_embd=hidden, n_layer=shape["layers"], n_head=heads, n_inner=ffn,
                         activation_function=shape.get("activation") or "gelu_new",
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = attn
        return GPT2LMHeadModel(cfg)
    if shape.get("experts"):  # a mixture of experts: Mixtral's layout, whatever the family
        return _mixtral(shape, hidden, heads, ffn, attn)
    if kind in _LLAMA_FAMILIES:
        cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=hidden,
                          intermediate_size=ffn or 4 * hidden, num_hidden_layers=shape["layers"],
                          num_attention_heads=heads,
                          num_key_value_heads=shape.get("kv_heads") or heads,
                          max_position_embeddings=shape["seq"], bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = attn
        return LlamaForCausalLM(cfg)
    raise ValueError(f"model_type={kind!r}: a trial builds GPT-2 or LLaMA-family models "
                     f"({', '.join(('gpt2', *_LLAMA_FAMILIES))}), or a Mixtral when the shape "
                     "gives experts and top_k; describe the model with one of those layouts")


def _mixtral(shape: dict[str, Any], hidden: int, heads: int, ffn: int | None,
             attn: str) -> nn.Module:
    """A Mixtral of the shape: ``experts`` fused experts of width ``ffn`` per block, ``top_k``
    of them per token (what the planner's expert terms count and the expert applier splits)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=shape["vocab"], hidden_size=hidden,
                        intermediate_size=ffn or 4 * hidden, num_hidden_layers=shape["layers"],
                        num_attention_heads=heads,
                        num_key_value_heads=shape.get("kv_heads") or heads,
                        num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                        tie_word_embeddings=bool(shape.get("tied_embeddings", False)),
                        max_position_embeddings=shape["seq"], bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    return MixtralForCausalLM(cfg)


def token_batch(step: int, rank: int, batch: int, seq: int,
                vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their next-token targets, different per step and rank."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:].contiguous()  # (b, s), (b, s)


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the logits against already-shifted targets, in fp32."""
    x, y = batch
    logits = model(input_ids=x).logits  # (b, s, vocab)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       y.reshape(-1))


def measure_memory(model: nn.Module, optimizer: Any, blocks: list[nn.Module],
                   micro: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
    """Model states at their peak + activations kept by one micro-batch."""
    from kernels_runtime.api import to_device
    from kernels_runtime.memory.saved_activations import peak_saved_bytes

    micro = to_device(micro, optimizer.ctx.device)

    def step() -> None:
        optimizer.backward(next_token_loss(model, micro))
        optimizer.finish_grad_sync()

    activations = peak_saved_bytes(step, blocks)
    states = optimizer.memory_breakdown()  # after backward: gradients reduced, states built
    optimizer.zero_grad()
    return {**states, "activations": activations}


def measure_pipeline_memory(model: nn.Module, optimizer: Any,
                            micros: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, int]:
    """This stage's model states at their peak + the most activations it held at once while
    running the schedule over ``micros`` (without the optimizer step)."""
    from kernels_runtime.calibrate.pipeline_memory import peak_live_bytes
    from kernels_runtime.parallel.state import parallel_state

    state = parallel_state(model)
    telemetry = optimizer.ctx.telemetry

    def step() -> None:
        state.schedule.run(model, optimizer, micros, next_token_loss, telemetry)

    activations = peak_live_bytes(step, state.blocks)
    states = optimizer.memory_breakdown()  # gradients reduced, states built
    optimizer.zero_grad()
    return {**states, "activations": activations}


def run_trial(plan: Plan | str, shape: dict[str, Any], *, batch: int, steps: int = 3,
              warmup: int = 1, comm: Any = None, lr: float = 1e-4) -> dict[str, Any]:
    """Train ``steps`` timed steps (after ``warmup``) of the model ``shape`` under ``plan`` with
    ``batch`` samples per data-parallel rank per step (shared by its tp, sp and pp ranks);
    returns this rank's step times (s), memory (bytes per category) and pipeline stage. The
    model is freed afterwards."""
    from kernels_runtime.api import parallelize, train_step
    from kernels_runtime.mesh.context import ParallelContext
    from kernels_runtime.policies import get_policy

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 0")
    ctx = ParallelContext.build(plan, comm)
    m = ctx.plan.microbatches
    if batch % m:
        raise ValueError(f"batch={batch} samples per rank do not split into microbatches={m}")
    model = build_model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, boosted = parallelize(model, optimizer, ctx=ctx)
    rank, size, seq, vocab = ctx.dp_rank, batch // m, int(shape["seq"]), int(shape["vocab"])

    def micros(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = token_batch(step, rank, batch, seq, vocab)
        return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(m)]

    try:
        train_step(model, boosted, micros(0), next_token_loss)  # warm-up: states built
        if ctx.plan.pp > 1:
            memory = measure_pipeline_memory(model, boosted, micros(1))
        else:
            memory = measure_memory(model, boosted, get_policy(model).blocks(model),
                                    micros(1)[0])
        for s in range(warmup):
            train_step(model, boosted, micros(2 + s), next_token_loss)
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            train_step(model, boosted, micros(2 + warmup + s), next_token_loss)
            times.append(time.perf_counter() - t0)
    finally:
        del model, boosted, optimizer
        gc.collect()
    return {"plan": ctx.plan.to_string(), "step_s": times, "memory": memory,
            "stage": ctx.coord("pp")}
