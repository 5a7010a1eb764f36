"""Tiers and the tensors that move between them: device -> host -> disk.

A ``Payload`` is one tensor of model state (a chunk's parameters, its gradient shard, fp32
master, an optimizer state). Its ``handle`` is a tensor object whose identity never changes,
because the model's parameters are views of it and the optimizer keys its state by it; only
``handle.data`` moves: to device memory, to (pinned, on a GPU machine) host memory, or to a file
of the spill directory, where ``handle.data`` is an empty tensor.

``TierStore`` moves payloads and keeps the accounts the placement decides by: bytes resident per
tier now and at peak (on a CPU-only machine device and host are the same RAM, so the device
tier is exactly this account, enforced by the placement as a GPU's capacity would be), bytes
moved between tiers (what was really copied or read and written: an eviction to disk whose
file still holds the values moves nothing), evictions, and time the caller waited on movement.
The disk half (write-behind, read-ahead, files kept as copies) is a ``DiskTraffic`` the store
owns (``disk_traffic.py``), given the store's allocation and accounts by its constructor. Host
buffers (and, on a host-only machine, device ones) are allocated aligned for direct I/O
(``disk_io.aligned_empty``), so the disk reads and writes them in place.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable

import torch

from kernels_runtime.comm.accelerator import Accelerator
from kernels_runtime.memory.buffer_pool import BufferPool, sole_owner
from kernels_runtime.memory.disk_io import aligned_empty
from kernels_runtime.memory.disk_traffic import DiskTraffic
from kernels_runtime.memory.payload import Payload, Tier

HOST_POOL_BYTES = 64 * 2**20  # freed host buffers kept for reuse (a host-only machine)


class TierStore:
    """Allocation, movement and accounting of payloads (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, disk: Callable[[], object] | None = None,
                 waiting: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.accelerator = accelerator
        self.device = accelerator.device
        self.used: Counter[Tier] = Counter()
        self.peak: Counter[Tier] = Counter()
        self.working: Counter[Tier] = Counter()  # of ``used``: transient buffers, not state
        self.state_peak: Counter[Tier] = Counter()  # peak of model state alone
        self.moved: Counter[tuple[str, str]] = Counter()  # bytes (from, to) since reset
        self.evictions = 0
        self.traffic = DiskTraffic(  # (``waiting``: the step split's "waiting" time)
            disk, host_empty=lambda numel, dtype: self._empty(numel, dtype, Tier.HOST),
            charge=self._add, uncharge=self._sub, release=self._release,
            waiting=waiting or contextlib.nullcontext)
        self._uploads: dict[str, tuple[torch.Tensor, object]] = {}  # host -> device prefetch
        self.uploads = 0  # prefetches to the device started (a GPU's side stream)
        self.activations = 0  # device bytes that are not model state (the placement's reserve)
        self.total_peak = 0  # of device model state, working buffers and activations together
        # freed buffers kept for the next allocation of their size (``buffer_pool.py``): on the
        # device under ``recycle``, charged as working memory and dropped before any eviction;
        # in (unpinned) host memory up to ``HOST_POOL_BYTES`` (or what ``size_host_pool`` asks),
        # outside the tiers' accounts
        self.recycle = False
        self._spares = BufferPool(limit=None)
        self.host_pool = BufferPool(limit=0 if accelerator.pin_memory else HOST_POOL_BYTES)

    # ---- accounting ----------------------------------------------------------------------
    def _add(self, tier: Tier, nbytes: int, working: bool = False) -> None:
        self.used[tier] += nbytes
        self.working[tier] += nbytes if working else 0
        self.peak[tier] = max(self.peak[tier], self.used[tier])
        if tier == Tier.DEVICE:
            self.total_peak = max(self.total_peak, self.used[tier] + self.activations)
        state = self.used[tier] - self.working[tier]
        self.state_peak[tier] = max(self.state_peak[tier], state)

    def _sub(self, tier: Tier, nbytes: int, working: bool = False) -> None:
        self.used[tier] -= nbytes
        self.working[tier] -= nbytes if working else 0

    def set_activations(self, nbytes: int) -> None:
        self.activations = nbytes
        self.total_peak = max(self.total_peak, self.used[Tier.DEVICE] + nbytes)

    def charge_working(self, nbytes: int) -> None:
        """A device working buffer the caller allocated (a gradient buffer)."""
        self._add(Tier.DEVICE, nbytes, working=True)

    def release_working(self, nbytes: int) -> None:
        self._sub(Tier.DEVICE, nbytes, working=True)

    def reset_step_counters(self) -> None:
        self.moved.clear()
        self.evictions = 0
        self.traffic.wait_seconds = 0.0
        self.total_peak = self.used[Tier.DEVICE] + self.activations
        for tier in Tier:
            self.peak[tier] = self.used[tier]
            self.state_peak[tier] = self.used[tier] - self.working[tier]

    # ---- the disk half, ``self.traffic`` (``disk_traffic.py``) ----------------------------
    @property
    def disk(self):  # noqa: ANN201 - a DiskStore (disk.py)
        return self.traffic.disk

    @property
    def wait_seconds(self) -> float:
        """Time the caller waited on disk reads and writes since ``reset_step_counters``."""
        return self.traffic.wait_seconds

    @property
    def file_bytes(self) -> int:
        return self.traffic.file_bytes

    @property
    def writes_skipped(self) -> int:
        return self.traffic.writes_skipped

    @property
    def write_behind_bytes(self) -> int:
        return self.traffic.write_behind_bytes

    @write_behind_bytes.setter
    def write_behind_bytes(self, nbytes: int) -> None:
        self.traffic.write_behind_bytes = nbytes

    def widen_write_behind(self, nbytes: int) -> None:
        self.traffic.widen_write_behind(nbytes)

    def modified(self, payload: Payload) -> None:
        self.traffic.modified(payload)

    def prefetch(self, payload: Payload) -> None:
        self.traffic.prefetch(payload)

    def drop_reads(self, keep: frozenset[str] | set[str] = frozenset()) -> int:
        return self.traffic.drop_reads(keep)

    def reap(self) -> None:
        self.traffic.reap()

    def settle(self) -> None:
        self.traffic.settle()

    def close(self) -> None:
        self.traffic.close()

    # ---- allocation ----------------------------------------------------------------------
    def size_host_pool(self, nbytes: int) -> None:
        """Keep up to ``nbytes`` of freed host buffers (never less than before): what a
        deferred chunk step keeps in flight at once (``deferred_step.py``), so the buffers it
        frees serve its next reads instead of leaving the process and faulting in anew (none
        on a GPU machine, whose pinned allocator caches blocks itself)."""
        if not self.accelerator.pin_memory and self.host_pool.limit is not None:
            self.host_pool.limit = max(self.host_pool.limit, int(nbytes))

    def _empty(self, numel: int, dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        """Uninitialised memory on ``tier``: a recycled buffer of this size if one is kept."""
        if tier == Tier.DEVICE:
            spare = self._spares.take(numel, dtype)
            if spare is not None:
                self._sub(Tier.DEVICE, spare.numel() * spare.element_size(), working=True)
                return spare
            if self.accelerator.queues_work:
                return torch.empty(numel, dtype=dtype, device=self.device)
        kept = self.host_pool.take(numel, dtype)
        if kept is not None:
            return kept
        return aligned_empty(numel, dtype, pin_memory=self.accelerator.pin_memory)

    def device_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled device buffer (a recycled one when there is one of its size); the
        caller charges it (``charge_working``)."""
        return self._empty(numel, dtype, Tier.DEVICE).zero_()

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._empty(numel, dtype, Tier.DEVICE)

    @property
    def spare_bytes(self) -> int:
        return self._spares.nbytes

    def drop_spares(self) -> int:
        """Let the recycled device buffers go (room is needed); the bytes they held."""
        freed = self._spares.clear()
        self._sub(Tier.DEVICE, freed, working=True)
        return freed

    def release_device_buffer(self, tensor: torch.Tensor) -> None:
        """A device buffer the caller is done with and nothing else refers to: kept for reuse
        under ``recycle`` (charged to the device until taken or dropped), else, on a host-only
        machine, in the host pool."""
        if self.recycle and self._spares.put(tensor):
            self._add(Tier.DEVICE, tensor.numel() * tensor.element_size(), working=True)
        elif not self.accelerator.queues_work:
            self.host_pool.put(tensor)

    def _release(self, payload: Payload, data: torch.Tensor) -> None:
        """``data`` held ``payload``'s values and the store is done with it: reused if nothing
        else refers to its memory (autograd keeps views of a chunk's parameters from their
        forward to their backward)."""
        if data.device.type == "cpu" and sole_owner(data, payload.viewed):
            self.host_pool.put(data)

    def allocate(self, key: str, numel: int, dtype: torch.dtype, tier: Tier,
                 persistent: bool = True) -> Payload:
        """A zero-filled payload resident on ``tier`` (device or host)."""
        handle = self._empty(numel, dtype, tier).zero_()
        payload = Payload(key, numel, dtype, handle, tier, persistent)
        self._add(tier, payload.nbytes, working=not persistent)
        return payload

    def adopt(self, key: str, tensor: torch.Tensor, tier: Tier) -> Payload:
        """A payload around an existing flat tensor (an optimizer's state), resident where it
        is now (``tier`` names the account it is charged to)."""
        payload = Payload(key, tensor.numel(), tensor.dtype, tensor, tier)
        self._add(tier, payload.nbytes)
        return payload

    def free(self, payload: Payload, recycle: bool = False) -> None:
        """Drop the payload's values everywhere (a gradient after its step). ``recycle``: its
        device memory may serve the next buffer of its size (only for a tensor nothing else
        refers to: a gathered chunk's may still be saved by autograd for backward)."""
        self.traffic.settle_write(payload)
        self.traffic.drop_read(payload)
        if self._uploads.pop(payload.key, None) is not None:
            self._sub(Tier.DEVICE, payload.nbytes)
        payload.copy_on_disk = False  # its file stays, for the next payload of its key
        self._sub(payload.tier, payload.nbytes, working=not payload.persistent)
        data = payload.handle.data
        payload.handle.data = torch.empty(0, dtype=payload.dtype)
        if recycle and payload.tier == Tier.DEVICE:
            self.release_device_buffer(data)
        elif recycle and payload.tier == Tier.HOST:
            self._release(payload, data)
        payload.tier = Tier.DEVICE
        payload.numel = 0

    # ---- movement ------------------------------------------------------------------------
    def move(self, payload: Payload, tier: Tier, fill: bool = True) -> None:
        """Make ``payload`` resident on ``tier`` (waiting for what it needs). ``fill=False``:
        the caller overwrites every value next, so none is read from disk."""
        if payload.tier == tier:
            return
        source = payload.tier
        upload = self._uploads.pop(payload.key, None)
        if upload is not None and tier != Tier.DEVICE:  # prefetched, then sent elsewhere
            self._sub(Tier.DEVICE, payload.nbytes)
            upload = None
        moved = payload.nbytes
        if source == Tier.DISK:
            data, moved = self.traffic.read_back(payload, fill)
            if not fill:
                payload.copy_on_disk = False
        else:
            data = payload.handle.data
        if tier > source:
            self.evictions += 1
        if upload is not None:  # copied on the side stream: the compute stream waits for it
            self.accelerator.wait_copy(*upload)
            payload.handle.data = upload[0]
            self._sub(tier, payload.nbytes)  # its device bytes were charged at the prefetch
        elif tier == Tier.DISK:
            host = data if data.device.type == "cpu" or payload.copy_on_disk \
                else self._to_host(data)
            moved = self.traffic.write_behind(payload, host)
            payload.handle.data = torch.empty(0, dtype=payload.dtype)
            if not moved:  # its file holds the values: the memory is free now
                self._release(payload, data)
        elif data is None:  # overwritten next: new memory, nothing read
            payload.handle.data = self._empty(payload.numel, payload.dtype, tier)
        elif (source == Tier.DISK and tier == Tier.HOST) or not self.accelerator.queues_work:
            # the read buffer is host memory already; on a host-only machine the device tier is
            # the same memory, so moving between it and the host is a change of account
            payload.handle.data = data
        else:
            target = self._empty(payload.numel, payload.dtype, tier)
            target.copy_(data, non_blocking=tier == Tier.DEVICE)
            payload.handle.data = target
        if moved:
            self.moved[(source.label, tier.label)] += moved
        self._add(tier, payload.nbytes)
        self._sub(source, payload.nbytes)
        payload.tier = tier
        if tier == Tier.DISK:
            self.traffic.reap()  # the payload is on the disk tier: a failed write restores it

    def _to_host(self, data: torch.Tensor) -> torch.Tensor:
        host = self._empty(data.numel(), data.dtype, Tier.HOST)
        host.copy_(data)  # blocking: the disk thread reads it next
        return host

    def prefetch_to_device(self, payload: Payload) -> None:
        """Start copying a host payload to the device on the side stream (a GPU only; on the
        host the device tier is the same memory). Charged to the device from now on."""
        if (not self.accelerator.queues_work or payload.tier != Tier.HOST
                or payload.key in self._uploads):
            return
        self._uploads[payload.key] = self.accelerator.copy_to_device_async(payload.handle.data)
        self.uploads += 1
        self._add(Tier.DEVICE, payload.nbytes)

    def cancel_uploads(self) -> int:
        """Drop the device copies prefetched and not yet used; the bytes they held."""
        freed = 0
        for key in list(self._uploads):
            target, _ = self._uploads.pop(key)
            self._sub(Tier.DEVICE, target.nbytes)
            freed += target.nbytes
        return freed
