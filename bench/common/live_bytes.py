"""Peak bytes of live tensors during a piece of work, counted as a device allocator would.

A CPU has no ``torch.cuda.max_memory_allocated``, and RSS mixes in the interpreter, the
allocator's free lists and page cache. What a GPU's caching allocator counts is the bytes of
every live tensor storage, so ``LiveBytes`` counts exactly that: a ``TorchDispatchMode`` sees
every op's outputs (forward, backward on the calling thread, the optimizer's in-place and
fused kernels) and registers each new storage once with a weak reference. Storages alive when
it starts (the parameters) count from the start. Dead storages are dropped lazily: ``now``
(which may still count storages that died) is an upper bound of the live bytes, so while it
plus an op's outputs stays at or under the peak the peak cannot move and nothing needs
sweeping; only when it would pass the peak are the dead ones dropped first. Sweeping before
every op gave the same peak at a cost quadratic in the live storages (a 39-layer plain step:
~3000 ops x ~1000 storages). The peak is at op granularity, which is where an allocator's
peak is too; what it leaves out is the allocator's rounding and fragmentation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes(model.parameters()) as live: step()``, then ``live.peak`` (bytes)."""

    def __init__(self, already_live: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._live: dict[int, tuple[int, StorageWeakRef]] = {}
        self.now = 0
        self.peak = 0
        for t in already_live:
            self._register(t)

    def _register(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        old = self._live.get(key)
        if old is not None:
            if not old[1].expired():
                return  # already counted (a view, or an in-place op's output)
            self.now -= self._live.pop(key)[0]  # a dead storage's address, reused
        if self.now + nbytes > self.peak:
            self._sweep()  # ``now`` may still count dead storages: make it exact first
        self._live[key] = (nbytes, StorageWeakRef(storage))
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _sweep(self) -> None:
        # the builtin ``StorageWeakRef.expired`` ends in, called directly: a sweep asks
        # every live storage, and the two Python wrappers around it were most of its cost
        expired = torch.UntypedStorage._expired
        dead = [k for k, (_, ref) in self._live.items() if expired(ref.cdata)]
        for key in dead:
            self.now -= self._live.pop(key)[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._register(t)
        return out


def plain_step_peak(spec: dict, fused: bool = True) -> dict:
    """The second step's peak live bytes of plain AdamW (``fused`` or not) on the model
    ``spec`` describes (``calibrate.trial.build_model``'s), the parameter count, and 16 bytes
    per parameter: the plain-PyTorch side of the memory and fine-tuning capacity rows."""
    from kernels_runtime.calibrate.trial import build_model, next_token_loss, token_batch

    model = build_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    numel = sum(p.numel() for p in model.parameters())
    peak = 0
    for step in range(2):
        states = [t for s in opt.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor)]
        with LiveBytes([*model.parameters(), *states]) as live:
            next_token_loss(model, token_batch(step, 0, 1, spec["seq"])).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak = max(peak, live.peak)
    return {"numel": numel, "peak": peak, "textbook": 16 * numel}
