"""Dynamic loss scaling for fp16: scale the loss up so small gradients survive in 16 bits;
on overflow (inf/nan anywhere in any rank's gradients) skip the step and halve the scale; after
``growth_interval`` clean steps double it again. bf16 and fp32 use ``NoLossScaler``.
"""

from __future__ import annotations

from typing import Any

import torch


class NoLossScaler:
    scale = 1.0

    def update(self, found_inf: bool) -> None:
        """Nothing to adapt without scaling."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class DynamicLossScaler(NoLossScaler):
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def has_inf_or_nan(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim float tensor, 1.0 if any tensor holds inf or nan (kept on device: no sync)."""
    flag = torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        flag = torch.maximum(flag, (~torch.isfinite(t)).any().float())
    return flag
