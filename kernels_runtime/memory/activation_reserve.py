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

When everything fits with room to spare the count is not needed: after a measured step whose
device peak (model state and working buffers) left room for ``ROOM_FACTOR`` times the
measured activations and that evicted nothing, micro-batches run without the hooks (two Python
calls per saved tensor, about 1% of a step), the reserve held at the measured size the whole
micro-batch (never less room than the count would leave). The fast path is left, and the next
micro-batch measured again, as soon as that room is not there: at a micro-batch's start when
the step's peak or the budget changed, as soon as the units' outputs add up to more than in
the micro-batch measured (a larger batch or sequence: the reserve grows by the same ratio at
once and room is made), and after a micro-batch during which anything was evicted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kernels_runtime.memory.placement import Placer
from kernels_runtime.memory.saved_activations import is_parameter
from kernels_runtime.memory.tiers import Tier

ROOM_FACTOR = 2  # the fast path's room: activations may double before the budget is touched



class ActivationReserve:
    """Per micro-batch counts of saved bytes feeding ``placer.reserve`` (module docstring)."""

    def __init__(self, placer: Placer, device: torch.device) -> None:
        self.placer = placer
        self.device = device
        self.step_peak = 0  # the largest micro-batch of the step running now
        self.last_peak = 0  # of the last step ended
        self._reference: list[int] = []  # unit outputs (running sums) of the largest measured
        self.unmeasured = 0  # micro-batches run on the fast path (cumulative)
        self._outputs: list[int] = []  # of the micro-batch running now
        self._unmeasured_now = False
        self._known = 0  # the reserve the micro-batch running now started with
        self._trusted = False  # the last step was measured or fast, and evicted nothing
        self._doubt = False  # the fast path was left: count until a micro-batch is measured
        self._last_step_device_peak = 0

    def roomy(self) -> bool:
        """Whether the next micro-batch may skip the count (module docstring)."""
        store = self.placer.store
        if not (self._trusted and self.last_peak and self._reference) or self._doubt \
                or store.evictions:
            return False
        budget = self.placer.budget[Tier.DEVICE]
        if budget is None:
            return True
        peak = max(self._last_step_device_peak, store.peak[Tier.DEVICE])
        return peak + ROOM_FACTOR * self.last_peak <= budget

    def note_outputs(self, nbytes: int) -> None:
        """A unit's forward produced outputs of ``nbytes``: the fast path's check that this
        micro-batch is no larger than the one measured, unit by unit."""
        self._outputs.append(self._outputs[-1] + nbytes if self._outputs else nbytes)
        if self._unmeasured_now:
            k = len(self._outputs) - 1
            measured = self._reference[min(k, len(self._reference) - 1)]
            if self._outputs[-1] > measured:
                self._grow(self._outputs[-1] / measured)

    def _grow(self, ratio: float) -> None:
        """This unmeasured micro-batch is larger than the measured one by ``ratio`` so far:
        the reserve grows by that ratio at once (an estimate, until one is measured) and the
        next micro-batch is counted."""
        self._doubt = True
        estimate = int(self._known * ratio) + 1
        if estimate > self.placer.reserve:
            self.placer.reserve = estimate
            self.placer.make_room(Tier.DEVICE, 0)

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        known = max(self.last_peak, self.step_peak)  # what a micro-batch was measured to keep
        if known:
            self.placer.plan_reserve(known)  # room made before the forward, not during it
        self._outputs, self._known = [], known
        if self.roomy():
            yield from self._unmeasured()
            return
        with self._measured():
            yield

    def _unmeasured(self) -> Iterator[None]:
        evictions = self.placer.store.evictions
        self._unmeasured_now = True
        self.unmeasured += 1
        try:
            yield
        finally:
            self._unmeasured_now = False
            if self.placer.store.evictions != evictions:
                self._doubt = True  # the room was not there: count the next one
        self.step_peak = max(self.step_peak, self.placer.reserve)

    @contextlib.contextmanager
    def _measured(self) -> Iterator[None]:
        packs: dict[int, list[int]] = {}  # storage -> [saves not yet used by backward, bytes]
        now, peak = [0], [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != self.device.type or is_parameter(t):
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

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.step_peak = max(self.step_peak, peak[0])
        if self._outputs and (not self._reference or self._outputs[-1] >= self._reference[-1]):
            self._reference = self._outputs
        self._doubt = False

    def end_step(self) -> None:
        """The step's peak is the next step's reserve from its start: model state makes room
        for it now (the activations do not exist yet, so this is not a peak). A step that
        evicted nothing on its way is one the fast path may follow (``roomy``)."""
        store = self.placer.store
        self._trusted = self.step_peak > 0 and not store.evictions and not self._doubt
        self._last_step_device_peak = store.peak[Tier.DEVICE]
        self.last_peak, self.step_peak = self.step_peak, 0
        self.placer.plan_reserve(self.last_peak)
