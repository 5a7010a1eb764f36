"""The conformance families wrapped in peft LoRA adapters, as a user fine-tunes them.

Every linear projection of each block gets a rank-8 adapter: LLaMA's seven (q, k, v, o, gate,
up, down), GPT-2's ``c_attn``, ``c_proj`` and ``c_fc`` (``Conv1D``, whence peft's
``fan_in_fan_out``), BERT's query, key, value and both ``dense``. peft starts B at zero, so
A's first gradient would be zero and prove nothing: here both factors start random (peft's
``init_lora_weights=False``), from a fixed seed, so every rank and the reference build the same
adapters. Dropout is off, as in the families themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.families import Family

RANK = 8
TARGETS = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "bert": ("query", "key", "value", "dense"),
}
LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_lora(family: Family, model: nn.Module, extra: tuple[str, ...] = (),
              **options: object) -> nn.Module:
    """``model`` as a ``PeftModel`` with a random rank-8 adapter on every block projection
    (and the ``extra`` modules); only the adapters train (peft freezes the rest)."""
    from peft import LoraConfig, get_peft_model

    targets = [*TARGETS.get(family.name, LLAMA), *extra]
    torch.manual_seed(1)
    config = LoraConfig(r=RANK, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False, fan_in_fan_out=family.name == "gpt2",
                        **options)
    return get_peft_model(model, config).eval()


def with_near_zero_lora(family: Family, model: nn.Module) -> nn.Module:
    """``with_lora`` with each B scaled down 100-fold: the model starts near its pretrained
    self, as a fine-tune does (peft's B starts at zero), yet A's first gradient is not zero.
    With B at full random size the real model's loss jumps to ~37 and five steps at its
    learning rate turn chaotic, where rounding differences of a split grow past 1e-5."""
    model = with_lora(family, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.mul_(0.01)
    return model


def with_dora(family: Family, model: nn.Module) -> nn.Module:
    """A LoRA variant tensor parallelism does not split (DoRA's magnitude vectors)."""
    return with_lora(family, model, use_dora=True)


def with_head_lora(family: Family, model: nn.Module) -> nn.Module:
    """An adapter on the vocabulary-parallel LM head too, which does not split yet."""
    return with_lora(family, model, extra=("lm_head",))


def split_lora_on_rank(rank: int, world: int, plan: str) -> dict:
    """LLaMA with adapters under ``plan``: what parallelize kept of peft's model (parameter
    names, layouts of the factors) and the logits with adapters on and off (peft's
    ``disable_adapter()``), against single-process peft and the model without adapters."""
    from conformance.families import FAMILIES, global_batch
    from kernels_runtime import parallelize_model

    from helpers.distributed import context

    family = FAMILIES["llama"]
    batch = global_batch(family, 0)
    plain = family.build()
    reference = with_lora(family, family.build())
    model = with_lora(family, family.build())
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        want_off = plain(**batch).logits
        want_on = reference(**batch).logits
        model = parallelize_model(model, plan, ctx=context(plan), verbose=False)
        on = model(**batch).logits
        with model.disable_adapter():
            off = model(**batch).logits
        again = model(**batch).logits
    layouts = {n: (layout.shape, [b[1] for b in layout.blocks], [b[2] for b in layout.blocks])
               for n, layout in model.parallel_state.layouts.items() if ".lora_" in n}
    return {"names": names == [n for n, _ in model.named_parameters()],
            "on": (on - want_on).abs().max().item(), "off": (off - want_off).abs().max().item(),
            "again": (again - on).abs().max().item(), "layouts": layouts}


def save_split_lora_on_rank(rank: int, world: int, plan: str, directory: str) -> None:
    """LLaMA with adapters trained one SGD step under ``plan``, saved to ``directory``."""
    from conformance.families import FAMILIES, pieces_of
    from kernels_runtime import parallelize, save, train_step

    from helpers.distributed import context

    family = FAMILIES["llama"]
    model = with_lora(family, family.build())
    ctx = context(plan)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=family.lr,
                                                    momentum=0.9), ctx=ctx, verbose=False)
    train_step(model, opt, pieces_of(family, 0, ctx.dp_size, 1)[ctx.dp_rank])
    save(directory, model, opt, step=1)
