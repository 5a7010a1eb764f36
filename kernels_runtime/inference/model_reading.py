"""What the engine reads from a model before serving it: its attention modules and hidden size
(by its policy, or the generic decoder's contract), and the ids that end a sequence."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from kernels_runtime.policies import find_module


def attention_modules(model: nn.Module, state: Any,
                       max_model_len: int | None) -> tuple[list[nn.Module] | None, int]:
    """(HF attention modules of this rank's blocks, hidden size), or (None, 0) for a decoder
    the generic policy covers, which must take ``position_ids`` and bound its context."""
    config = getattr(model, "config", None)
    layout = state.policy.model_layout(model)
    if config is not None and layout is not None and layout.attention is not None:
        if not layout.attention.causal:
            raise TypeError(f"the inference engine serves causal decoders; "
                            f"{type(model).__name__} attends both ways")
        return ([find_module(b, layout.attention.path)[1] for b in state.blocks],
                int(config.hidden_size))
    name = type(model).__name__
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise TypeError(f"{name} is served as a generic decoder, whose forward must take "
                        "position_ids (the engine runs every request's tokens in one row, "
                        "each at its own position): forward(input_ids, position_ids)")
    if not max_model_len:
        raise TypeError(f"{name} is served as a generic decoder: give its context length, "
                        "Engine(..., max_model_len=N)")
    if state.ctx.size("pp") > 1:
        raise TypeError(f"{name}: inference pipelines need an HF decoder (their stages run "
                        "the model's own forward); use tp or dp replicas")
    return None, 0


def eos_token_ids(model: nn.Module) -> set[int]:
    """Every end-of-sequence id the model's generation config and config name (a list or one)."""
    out: set[int] = set()
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(config, "eos_token_id", None)
        if value is None:
            continue
        out.update(value if isinstance(value, (list, tuple)) else [value])
    return {int(v) for v in out}
