"""Peak activation memory of a training step: the most bytes autograd holds saved for backward
at any one time.

A schedule does not change what one micro-batch saves, only how many micro-batches' saved
tensors are alive together: GPipe keeps all m until the backwards begin, 1F1B at most p on the
first stage. Summing what forwards save (``SavedActivations``) cannot see that; watching each
saved tensor until autograd frees it after its backward can, and needs no allocator counter
(there is none on a CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_runtime.memory.saved_activations import _is_parameter


class _Held:
    """What autograd stores in place of a saved tensor: the tensor, and a count of this
    storage's holders that drops when autograd frees the saved variable (after its backward)."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: PeakSaved, tensor: torch.Tensor) -> None:
        self.meter, self.tensor = meter, tensor
        storage = tensor.untyped_storage()
        self.key = (storage.data_ptr(), storage.nbytes())
        meter._hold(self.key)

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Held) else saved


class PeakSaved:
    """``with PeakSaved() as peak: step()``: ``peak.bytes`` is the largest number of bytes of
    distinct storages autograd held saved for backward at any one time (parameters excluded:
    model state, not activations). ``SavedActivations`` sums what a forward saves; a pipeline
    schedule frees micro-batches' saved tensors in its own order, so this one also watches
    them go. What code keeps outside autograd is not seen: zbv's deferred weight gradients
    hold their linears' inputs from B until W."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, int], int] = {}
        self.now = self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        return t if _is_parameter(t) else _Held(self, t)

    def _hold(self, key: tuple[int, int]) -> None:
        if not self.live.get(key):
            self.now += key[1]
            self.bytes = max(self.bytes, self.now)
        self.live[key] = self.live.get(key, 0) + 1

    def _release(self, key: tuple[int, int]) -> None:
        self.live[key] -= 1
        if not self.live[key]:
            del self.live[key]
            self.now -= key[1]

    def __enter__(self) -> PeakSaved:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
