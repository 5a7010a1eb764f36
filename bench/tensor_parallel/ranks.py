"""The rank side of ``python -m bench tensor_parallel``: the models, and what is counted on them.

Four variants of one HF LLaMA (same seed, same weights): ours under "tp=2" and "tp=2
sp_mode=split_gather", and PyTorch DTensor's ``parallelize_module`` without and with
``SequenceParallel`` norms; all four take the loss from vocabulary-sharded logits (ours
``vocab_parallel_cross_entropy``, DTensor ``loss_parallel``), so they compute the same thing.
DTensor's collectives bypass our ``Collectives``: for DTensor only ``wchar`` is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.common.layer_meter import LayerMeter, LocalSavedActivations
from bench.common.timing import time_variants
from bench.tensor_parallel.formulas import Shape


# ---- the four models ----------------------------------------------------------------------
def build_model(shape: Shape) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab, max_position_embeddings=shape.seq, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def token_batch(shape: Shape, step: int) -> torch.Tensor:
    """The step's (b, s) token ids, the same on every tp rank."""
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq),
                         generator=torch.Generator().manual_seed(step))


def dtensor_model(shape: Shape, mesh, sp: bool) -> nn.Module:
    """The same LLaMA under ``parallelize_module``, as PyTorch's TP tutorial plans Llama.

    HF LLaMA (transformers 5.x) reads its head counts from the config and reshapes with -1
    heads (``view(b, s, -1, head_dim)``), and ``num_key_value_groups`` (a / kv) does not change
    when both are split, so the attention modules need no local head counts."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = build_model(shape)
    head = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                           output_layouts=Shard(-1), use_local_output=False)  # for loss_parallel
    outer = {"lm_head": head, "model.embed_tokens": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(),
        use_local_output=not sp)}  # under SP a DTensor, so HF reads the global (b, s, h) shape
    if sp:
        outer["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, outer)
    for layer in model.model.layers:
        plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                     "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        if sp:
            out = {"output_layouts": Shard(1), "use_local_output": False}
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(  # HF passes hidden_states by keyword
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
                "self_attn.o_proj": RowwiseParallel(**out),
                "mlp.down_proj": RowwiseParallel(**out)})
        parallelize_module(layer, mesh, plan)
    return model


def dtensor_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss from the vocabulary-sharded logits (``loss_parallel``)."""
    from torch.distributed.tensor.parallel import loss_parallel

    hidden = model.model(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden)  # DTensor (b, s, V), Shard(-1)
    with loss_parallel():
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def dtensor_backward(loss: torch.Tensor) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss.backward()


VARIANTS = ("ours 1D", "ours 1D+SP", "DTensor 1D", "DTensor 1D+SP")


@dataclass
class Variant:
    model: nn.Module
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, ids) -> loss
    backward: Callable[[torch.Tensor], None]
    step: Callable[[int], float]  # one training step on batch ``step``; returns its loss
    stats: Any  # our collectives' CommStats; None for DTensor (not instrumented)


def make_variant(name: str, shape: Shape, comm) -> Variant | str:
    """The variant, or why it did not run as asked (our plan refused, or not applied)."""
    from kernels_runtime import parallelize, train_step
    from kernels_runtime.mesh.context import ParallelContext
    from kernels_runtime.mesh.plan import PlanError

    sp = name.endswith("+SP")
    if name.startswith("DTensor"):
        mesh = ParallelContext.build(f"tp={shape.tp}", comm).mesh["tp"]
        model = dtensor_model(shape, mesh, sp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return Variant(model, dtensor_forward, dtensor_backward,
                       lambda s: _dtensor_step(model, opt, token_batch(shape, s)), None)
    plan = f"tp={shape.tp} sp_mode=split_gather" if sp else f"tp={shape.tp}"
    model = build_model(shape)
    try:
        model, bopt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  ctx=ParallelContext.build(plan, comm), verbose=False)
    except PlanError as err:
        return f"{plan!r} refused: {err}"
    applied = model.parallel_state.applied
    if sp and not any(a.startswith("sequence") for a in applied):
        return (f"{plan!r} accepted but no sequence applier ran (applied: "
                f"{', '.join(applied)}): it would train as plain 1D")
    return Variant(model, ours_forward, bopt.backward,
                   lambda s: train_step(model, bopt, [(token_batch(shape, s),) * 2]).loss,
                   comm.stats)


def ours_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from kernels_runtime.api.objective import causal_lm_loss

    return causal_lm_loss(model, (ids, ids))  # vocabulary-parallel: local logits only


def _dtensor_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = dtensor_forward(model, ids)
    dtensor_backward(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.full_tensor().item()


def _comm(comm_for: Callable[[], Any] | None):
    from kernels_runtime.comm import Collectives

    return comm_for() if comm_for is not None else Collectives()


# ---- counting (no timing) -----------------------------------------------------------------
def count(rank: int, world: int, shape: Shape, variants: tuple[str, ...] = VARIANTS,
          comm_for: Callable[[], Any] | None = None) -> dict:
    """Per variant, of one step: collective and socket bytes per block and pass (and per
    pass in all), and bytes saved for backward per block; or why the variant did not run.
    ``comm_for()`` gives the rank's ``Collectives`` (default: a new one)."""
    comm = _comm(comm_for)
    results: dict[str, Any] = {}
    for name in variants:
        variant = make_variant(name, shape, comm)
        results[name] = variant if isinstance(variant, str) else _count_one(variant, shape)
    return results


def _count_one(v: Variant, shape: Shape) -> dict:
    return measure_step(v, token_batch(shape, 0), LayerMeter)


def measure_step(v: Any, ids: torch.Tensor, meter_class: type = LayerMeter) -> dict:
    """One warm-up step, then one step metered per block and pass, then one step whose saved
    activations are counted per block (shared with the grid benchmark's variants)."""
    blocks = list(v.model.model.layers)
    v.backward(v.forward(v.model, ids))  # warm-up: lazy communicator and allocator set-up
    with meter_class(blocks, v.stats) as meter:
        meter.mark()
        loss = v.forward(v.model, ids)
        meter.mark()
        v.backward(loss)
        meter.mark()
    with LocalSavedActivations(blocks) as saved:
        loss = v.forward(v.model, ids)
    v.backward(loss)  # gradients accumulate over these steps: nothing here reads them
    return {"blocks": meter.blocks, "passes": meter.passes,
            "saved": [saved.by_block[f"block{i}"] for i in range(len(blocks))]}


# ---- timing ---------------------------------------------------------------------------------
def timed(rank: int, world: int, shape: Shape, rounds: int, steps: int,
          variants: tuple[str, ...] = VARIANTS, comm_for: Callable[[], Any] | None = None
          ) -> dict:
    """Per variant: its first step's loss (same weights, same batch everywhere) and the median
    step time of each round; each round runs ``steps`` steps of every variant, in an order
    that rotates from round to round."""
    comm = _comm(comm_for)
    return time_variants({name: make_variant(name, shape, comm) for name in variants},
                         rounds, steps)
