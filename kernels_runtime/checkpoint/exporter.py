"""``export_hf``: a training checkpoint as ordinary model weights, in one process.

Training checkpoints are sharded by rank and carry optimizer states; serving, evaluation and
the Hugging Face hub want one set of full weights. This assembles each parameter's fp32 master
from all rank files (no process group needed), loads it into an unparallelized model of the
same architecture, and writes it with ``save_pretrained`` (safetensors), or as a plain
``model.safetensors`` for models without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.checkpoint.loader import check_parameters
from kernels_runtime.checkpoint.reader import CheckpointReader


def export_hf(
    checkpoint: str | os.PathLike, model: nn.Module, out_dir: str | os.PathLike, *,
    merged: bool = False,
) -> Path:
    """Write the weights of ``checkpoint`` (a checkpoint directory, meaning its ``latest``, or
    one step folder) through ``model`` into ``out_dir``; return ``out_dir``.

    ``model`` ends up holding the checkpoint's weights, in its own dtypes. For a peft model the
    folder is peft's adapter folder (what ``PeftModel.from_pretrained`` loads over the base);
    with ``merged`` the adapters are folded into the base weights instead
    (``merge_and_unload``) and the folder is an ordinary ``save_pretrained`` model that any
    runtime loads without peft (``model`` is then the base with the adapters merged).
    """
    step_dir = fmt.resolve_step_dir(checkpoint, None)
    meta = fmt.read_meta(step_dir)
    check_parameters(meta, model, strict=True, where=str(step_dir))
    params = dict(model.named_parameters())
    with CheckpointReader(step_dir, meta) as reader:
        weights = {n: reader.full(n).to(params[n].dtype) for n in meta["params"]}
    _load_weights(model, weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if merged:
        if not hasattr(model, "merge_and_unload"):
            raise CheckpointError(f"export_hf(..., merged=True) merges LoRA adapters, but "
                                  f"{type(model).__name__} has none (it is not a peft model); "
                                  "export it without merged=True")
        model = model.merge_and_unload()
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(str(out))
    else:
        save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt", "step": str(meta["step"])})
    return out


def _load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """``load_state_dict(strict=False)``, allowing only tied parameters (GPT-2's ``lm_head``
    shares ``wte``'s storage), buffers and frozen parameters (never in a checkpoint: they
    keep the model's values) to be absent."""
    result = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    loaded = {state[n].data_ptr() for n in weights}
    kept = {n for n, _ in model.named_buffers()}
    kept |= {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    untied = [n for n in result.missing_keys
              if n not in kept and state[n].data_ptr() not in loaded]
    if untied or result.unexpected_keys:
        raise CheckpointError(f"exporting {sorted(weights)[:3]}... into {type(model).__name__}: "
                              f"missing {untied}, unexpected {result.unexpected_keys}")
