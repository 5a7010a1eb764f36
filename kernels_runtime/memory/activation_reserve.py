"""The device memory a step needs besides model state, measured while it runs.

Placement keeps model state under ``device_mem``, but a micro-batch's forward keeps activations
on the device until its backward, and the budget must leave them room. They are measured, not
predicted: while a micro-batch runs, ``saved_tensors_hooks`` see every tensor autograd keeps for
backward; the distinct storages that are not parameters (those are chunk payloads, already in
the accounts) are added up as they appear. The placement's device reserve follows that count as
it grows, so during the first (warm-up) step model state is evicted as activations accumulate,
before the next unit is gathered; from the second step on the reserve starts at the largest
micro-batch measured so far (room is made before each micro-batch's forward), so the steady
state keeps model state under the budget less what a micro-batch is known to need. In backward
the reserve follows the activations down: a saved tensor is let go once backward has used its
last save (the unpack hook), which leaves room for the gradient buffers backward needs. Tensors
saved inside an activation-checkpointed region are the checkpoint's own business (its inner
hooks take them), so only what it keeps is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from kernels_runtime.memory.placement import Placer
from kernels_runtime.memory.tiers import Tier


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class ActivationReserve:
    """Per micro-batch counts of saved bytes feeding ``placer.reserve`` (module docstring)."""

    def __init__(self, placer: Placer, device: torch.device) -> None:
        self.placer = placer
        self.device = device
        self.step_peak = 0  # the largest micro-batch of the step running now
        self.last_peak = 0  # of the last step ended

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        packs: dict[int, list[int]] = {}  # storage -> [saves not yet used by backward, bytes]
        now, peak = [0], [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != self.device.type or _is_parameter(t):
                return t
            storage = t.untyped_storage()
            entry = packs.setdefault(storage.data_ptr(), [0, storage.nbytes()])
            if entry[0] == 0:
                now[0] += entry[1]
                peak[0] = max(peak[0], now[0])
                if now[0] > self.placer.reserve:  # the warm-up step: evict as it grows
                    self.placer.reserve = now[0]
                    self.placer.make_room(Tier.DEVICE, 0)
            entry[0] += 1
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            entry = packs.get(t.untyped_storage().data_ptr()) if t.numel() else None
            if entry is not None and entry[0] > 0:
                entry[0] -= 1
                if entry[0] == 0:  # backward used its last save: autograd lets it go
                    now[0] -= entry[1]
                    self.placer.reserve = now[0]
            return t

        known = max(self.last_peak, self.step_peak)  # what a micro-batch was measured to keep
        if known:
            self.placer.plan_reserve(known)  # room made before the forward, not during it
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.step_peak = max(self.step_peak, peak[0])

    def end_step(self) -> None:
        """The step's peak is the next step's reserve from its start: model state makes room
        for it now (the activations do not exist yet, so this is not a peak)."""
        self.last_peak, self.step_peak = self.step_peak, 0
        self.placer.plan_reserve(self.last_peak)
