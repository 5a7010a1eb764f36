"""Tiers and the tensors that move between them: device -> host -> disk.

A ``Payload`` is one tensor of model state (a chunk's parameters, its gradient shard, fp32
master, an optimizer state). Its ``handle`` is a tensor object whose identity never changes,
because the model's parameters are views of it and the optimizer keys its state by it; only
``handle.data`` moves: to device memory, to (pinned, on a GPU machine) host memory, or to a file
of the spill directory, where ``handle.data`` is an empty tensor.

``TierStore`` moves payloads and keeps the accounts the placement decides by: bytes resident per
tier now and at peak (on a CPU-only machine device and host are the same RAM, so the device
tier is exactly this account, enforced by the placement as a GPU's capacity would be), bytes
moved between tiers, evictions, and time the caller waited on movement. Disk writes are
write-behind (the memory is freed when the write completes; a fetch before that reuses it) and
disk reads can be started early (``prefetch``), both on the disk store's threads.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kernels_runtime.comm.accelerator import Accelerator

WRITE_BEHIND_BYTES = 64 * 2**20  # the most spilled bytes still held in memory while written


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(eq=False)
class Payload:
    key: str
    numel: int
    dtype: torch.dtype
    handle: torch.Tensor = field(repr=False)
    tier: Tier = Tier.DEVICE
    persistent: bool = True  # model state (False: a transient working buffer)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class TierStore:
    """Allocation, movement and accounting of payloads (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, disk: Callable[[], object] | None = None,
                 waiting: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.accelerator = accelerator
        self._waiting = waiting or contextlib.nullcontext  # the step split's "waiting" time
        self.device = accelerator.device
        self._disk_factory = disk
        self._disk = None
        self.used: Counter[Tier] = Counter()
        self.peak: Counter[Tier] = Counter()
        self.working: Counter[Tier] = Counter()  # of ``used``: transient buffers, not state
        self.state_peak: Counter[Tier] = Counter()  # peak of model state alone
        self.moved: Counter[tuple[str, str]] = Counter()  # bytes (from, to) since reset
        self.evictions = 0
        self.wait_seconds = 0.0
        self._reads: dict[str, tuple[Future, torch.Tensor]] = {}
        self._writes: dict[str, tuple[Future, torch.Tensor, Payload]] = {}
        self._uploads: dict[str, tuple[torch.Tensor, object]] = {}  # host -> device prefetch
        self.uploads = 0  # prefetches to the device started (a GPU's side stream)
        self.write_behind_bytes = WRITE_BEHIND_BYTES
        self.activations = 0  # device bytes that are not model state (the placement's reserve)
        self.total_peak = 0  # of device model state, working buffers and activations together
        # freed device buffers kept for the next allocation of their size (``recycle``)
        self.recycle = False
        self._spares: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.spare_bytes = 0

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
        self.wait_seconds = 0.0
        self.total_peak = self.used[Tier.DEVICE] + self.activations
        for tier in Tier:
            self.peak[tier] = self.used[tier]
            self.state_peak[tier] = self.used[tier] - self.working[tier]

    @property
    def disk(self):
        if self._disk is None:
            if self._disk_factory is None:
                raise RuntimeError("no disk tier was configured for this placement")
            self._disk = self._disk_factory()
        return self._disk

    # ---- allocation ----------------------------------------------------------------------
    def _empty(self, numel: int, dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        if tier == Tier.DEVICE:
            spare = self._take_spare(numel, dtype)
            if spare is not None:
                return spare
            return torch.empty(numel, dtype=dtype, device=self.device)
        return torch.empty(numel, dtype=dtype, pin_memory=self.accelerator.pin_memory)

    def device_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled device buffer (a recycled one when there is one of its size); the
        caller charges it (``charge_working``)."""
        return self._empty(numel, dtype, Tier.DEVICE).zero_()

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._empty(numel, dtype, Tier.DEVICE)

    # Recycling (a host-only machine under ``auto``): glibc hands every freed buffer larger
    # than 64 KiB back to the system (``host_malloc.py``), so a chunk-sized buffer allocated
    # anew every step pays a page fault per 4 KiB page, about as much as all its arithmetic
    # (measured 40 ms per 100 MB here). Freed device buffers are kept, charged to the device
    # as working memory, for the next allocation of the same size; the placement drops them
    # before it evicts anything (``drop_spares``), so they only ever use room nobody needs.
    # A GPU's caching allocator does this already, so there the store keeps nothing.
    def _keep_spare(self, tensor: torch.Tensor) -> None:
        self._spares.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.spare_bytes += nbytes
        self._add(Tier.DEVICE, nbytes, working=True)

    def _take_spare(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        spares = self._spares.get((numel, dtype))
        if not spares:
            return None
        tensor = spares.pop()
        nbytes = tensor.numel() * tensor.element_size()
        self.spare_bytes -= nbytes
        self._sub(Tier.DEVICE, nbytes, working=True)
        return tensor

    def drop_spares(self) -> int:
        """Let the recycled buffers go (room is needed); the bytes they held."""
        freed = self.spare_bytes
        self._sub(Tier.DEVICE, freed, working=True)
        self._spares.clear()
        self.spare_bytes = 0
        return freed

    def release_device_buffer(self, tensor: torch.Tensor) -> None:
        """A device buffer the caller is done with and nothing else refers to (kept for reuse
        when recycling)."""
        if self.recycle and tensor.numel():
            self._keep_spare(tensor)

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
        self._settle_write(payload)
        if self._uploads.pop(payload.key, None) is not None:
            self._sub(Tier.DEVICE, payload.nbytes)
        if payload.tier == Tier.DISK:
            self.disk.delete(payload.key)
        self._sub(payload.tier, payload.nbytes, working=not payload.persistent)
        if recycle and payload.tier == Tier.DEVICE:
            self.release_device_buffer(payload.handle.data)
        payload.handle.data = torch.empty(0, dtype=payload.dtype)
        payload.tier = Tier.DEVICE
        payload.numel = 0

    # ---- movement ------------------------------------------------------------------------
    def move(self, payload: Payload, tier: Tier) -> None:
        """Make ``payload`` resident on ``tier`` (waiting for what it needs)."""
        if payload.tier == tier:
            return
        source = payload.tier
        upload = self._uploads.pop(payload.key, None)
        if upload is not None and tier != Tier.DEVICE:  # prefetched, then sent elsewhere
            self._sub(Tier.DEVICE, payload.nbytes)
            upload = None
        data = self._read_back(payload) if source == Tier.DISK else payload.handle.data
        self.moved[(source.label, tier.label)] += payload.nbytes
        if tier > source:
            self.evictions += 1
        if upload is not None:  # copied on the side stream: the compute stream waits for it
            self.accelerator.wait_copy(*upload)
            payload.handle.data = upload[0]  # its device bytes were charged at the prefetch
        elif tier == Tier.DISK:
            host = data if data.device.type == "cpu" else self._to_host(data)
            self._writes[payload.key] = (self.disk.write(payload.key, host), host, payload)
            payload.handle.data = torch.empty(0, dtype=payload.dtype)
            self._add(Tier.DISK, payload.nbytes)
        elif (source == Tier.DISK and tier == Tier.HOST) or not self.accelerator.queues_work:
            # the read buffer is host memory already; on a host-only machine the device tier is
            # the same memory, so moving between it and the host is a change of account
            payload.handle.data = data
            self._add(tier, payload.nbytes)
        else:
            target = self._empty(payload.numel, payload.dtype, tier)
            target.copy_(data, non_blocking=tier == Tier.DEVICE)
            payload.handle.data = target
            self._add(tier, payload.nbytes)
        self._sub(source, payload.nbytes)
        payload.tier = tier
        if tier == Tier.DISK:
            self._reap()  # the payload is on the disk tier: a failed write restores it

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

    def prefetch(self, payload: Payload) -> None:
        """Start reading a disk payload back into host memory (no wait)."""
        if payload.tier != Tier.DISK or payload.key in self._reads:
            return
        if payload.key in self._writes:  # still in memory: the fetch will reuse it
            return
        buffer = self._empty(payload.numel, payload.dtype, Tier.HOST)
        self._reads[payload.key] = (self.disk.read(payload.key, buffer), buffer)
        self._add(Tier.HOST, payload.nbytes)  # the read buffer is host memory from now on

    def _read_back(self, payload: Payload) -> torch.Tensor:
        written = self._writes.pop(payload.key, None)
        if written is not None:  # write-behind not collected yet: its memory still holds it
            self._collect(written)
            self.disk.delete(payload.key)
            return written[1]
        self.prefetch(payload)
        future, buffer = self._reads.pop(payload.key)
        self._wait(future)
        self._sub(Tier.HOST, payload.nbytes)  # re-charged by the move to its new tier
        self.disk.delete(payload.key)  # the spill folder holds exactly the disk tier
        return buffer

    def _wait(self, future: Future) -> None:
        start = time.perf_counter()
        try:
            if not future.done():
                with self._waiting():
                    future.result()
            future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _collect(self, written: tuple[Future, torch.Tensor, Payload]) -> None:
        """Wait for a write-behind. If it failed, the payload is back in host memory (its values
        were still there) before the error is raised: a spill that did not complete loses
        nothing and is never read as complete."""
        future, host, payload = written
        try:
            self._wait(future)
        except OSError:
            self._restore(host, payload)
            for key in list(self._writes):  # the other writes in flight may fail the same way
                other = self._writes.pop(key)
                try:
                    self._wait(other[0])
                except OSError:
                    self._restore(*other[1:])
            raise

    def _restore(self, host: torch.Tensor, payload: Payload) -> None:
        if payload.tier == Tier.DISK:
            payload.handle.data = host
            payload.tier = Tier.HOST
            self._sub(Tier.DISK, payload.nbytes)
            self._add(Tier.HOST, payload.nbytes)

    def _reap(self) -> None:
        """Release the memory of completed write-behinds, and wait for the oldest while more
        than ``write_behind_bytes`` are in flight: spilling must not hold what it spilled."""
        pending = 0
        for key, (future, _host, payload) in reversed(list(self._writes.items())):
            pending += payload.nbytes
            if future.done() or pending > self.write_behind_bytes:
                self._collect(self._writes.pop(key))

    def _settle_write(self, payload: Payload) -> None:
        written = self._writes.pop(payload.key, None)
        if written is not None:
            self._collect(written)

    def settle(self) -> None:
        """Wait for every write-behind (their memory is released) and surface any error."""
        failed = None
        for key in list(self._writes):
            try:
                self._collect(self._writes.pop(key))
            except OSError as err:
                failed = failed or err
        if failed is not None:
            raise failed

    def close(self) -> None:
        with contextlib.suppress(OSError):  # closing (the model is gone): nothing to keep
            self.settle()
        for future, _ in self._reads.values():
            future.cancel()
        self._reads.clear()
        if self._disk is not None:
            self._disk.close()
