"""Model FLOPs of training, estimated from the parameter count.

Achieved FLOP/s is only comparable across plans and hardware if everyone counts the same FLOPs,
so we use the standard estimate (PaLM, Chowdhery et al. 2022, appendix B; Kaplan et al. 2020
without the attention term): per token, forward + backward cost

    6 * Psi            (every parameter takes part in one multiply-add forward, two backward)
  + 12 * L * d * T     (attention scores and weighted values: L layers, width d, sequence T)

Recomputation from activation checkpointing is not counted: these are *model* FLOPs, as in MFU.
Duck-typed (``model.parameters()``, ``model.config``) so that this module needs no torch.
"""

from __future__ import annotations

from typing import Any


def training_flops_per_token(
    n_params: int, *, n_layers: int | None = None, hidden: int | None = None,
    seq_len: int | None = None,
) -> float:
    """6 * Psi, plus the attention term 12 * L * d * T when layers, width and length are known."""
    flops = 6.0 * n_params
    if n_layers and hidden and seq_len:
        flops += 12.0 * n_layers * hidden * seq_len
    return flops


def model_shape(model: Any) -> tuple[int, int | None, int | None]:
    """(parameter count, layers, hidden width) of ``model``; layers and width come from an
    HF-style ``config`` (``num_hidden_layers``, ``hidden_size``) and are None without one.

    Sharded parameters (FSDP2's DTensors) report their global element count, and ZeRO's flat
    buckets keep full-size parameter views, so this is the whole model's Psi on every rank."""
    n_params = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    return n_params, (int(layers) if layers else None), (int(hidden) if hidden else None)
