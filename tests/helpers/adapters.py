"""Random LoRA adapters made with peft, and the reference they are served against.

An adapter here is what a user brings: ``get_peft_model`` over the base model with a
``LoraConfig`` on every attention and MLP projection, its factors random
(``init_lora_weights=False``, so B is not zero and the adapter changes the answers), saved
with ``save_pretrained``. B is scaled down by ``strength`` so the adapted model still has
confident logits (greedy parity means something only away from near-ties). The reference is
HF ``generate`` on the base model with the adapter merged into its weights
(``merge_and_unload``), one prompt at a time.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: nn.Module, folder: Path, names: tuple[str, ...] = ("a", "b"),
                  strength: float = 0.25, r: int = 8) -> dict[str, str]:
    """{name: adapter folder}: one random adapter per name (seeded by its position)."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, name in enumerate(names):
        torch.manual_seed(1000 + i)
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
            r=r, lora_alpha=2 * r, init_lora_weights=False, target_modules=TARGETS))
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "lora_B" in key:
                    param.mul_(strength)
        path = folder / name
        peft_model.save_pretrained(str(path))
        out[name] = str(path)
    return out


def merged(model: nn.Module, adapter: str | None) -> nn.Module:
    """A copy of ``model`` with ``adapter`` merged into its weights (the base for None)."""
    from peft import PeftModel

    copied = copy.deepcopy(model)
    if adapter is None:
        return copied.eval()
    return PeftModel.from_pretrained(copied, adapter).merge_and_unload().eval()


def merged_greedy(model: nn.Module, adapter: str | None, prompts: list[list[int]],
                  new: int) -> list[list[int]]:
    """HF ``generate``'s greedy new tokens of each prompt, alone, under the merged adapter."""
    reference = merged(model, adapter)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            x = torch.tensor([prompt])  # the mask given: generate masks pad ids it is not told
            ids = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                     do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out
