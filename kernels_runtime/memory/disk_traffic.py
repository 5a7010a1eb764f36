"""Traffic between memory and the disk tier: write-behind, read-ahead, and files kept as copies.

The disk half of ``TierStore`` (``tiers.py``), an object it owns: what it reads of the store
(host buffers, the tiers' accounts, the pool freed memory goes to) comes through its constructor
as the store's functions, and everything else it reads is its own. Writes are
write-behind: the memory is released when the write completes, at most ``write_behind_bytes``
in flight (a fetch before completion reuses it). Reads can start early (``prefetch``) and are
waited for at the fetch. Both run on the disk store's threads (``disk.py``). A read-ahead of a
payload whose write is still in flight reads nothing: the write's memory is kept for the fetch
when the write completes (``_wanted``), instead of being released and read back from disk at
the fetch, synchronously (measured on the disk tier's bench: 30-40 ms a step the compute thread
waited on a gradient read that way, behind the read-aheads queued before it).

A payload's file outlives its read-back: while the payload's values are unchanged it is a copy
(``Payload.copy_on_disk``), so evicting the payload again costs no write, only the memory it
frees (parameters are read for every forward and backward and change once per step: under
``offload_params`` this halves their disk traffic). Whoever changes a payload's values says so
first (``TierStore.modified``, which ``Placer.bring`` calls unless told the use only reads);
the file is then stale and is rewritten in place at the next eviction. A payload's file stays
when the payload is freed (a gradient after its step), for the next payload of its key to
rewrite in place, so the spill folder holds at most one file per payload key: exactly
``file_bytes``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kernels_runtime.memory.payload import Payload, Tier

WRITE_BEHIND_BYTES = 64 * 2**20  # the most spilled bytes still held in memory while written


class DiskTraffic:
    """Write-behind, read-ahead and the files of payloads (module docstring).

    ``disk``: makes the disk store (``disk.py``) at its first use, or None (no disk tier);
    ``host_empty(numel, dtype)``: an uninitialised (aligned) host buffer; ``charge`` and
    ``uncharge(tier, nbytes, working=False)``: the store's accounts (a read-ahead's buffer is
    working memory: the payload's state is still on disk); ``release(payload, data)``: memory that
    held a payload's values, for reuse; ``waiting``: the context the caller's waits run in."""

    def __init__(
        self, disk: Callable[[], object] | None, *,
        host_empty: Callable[[int, torch.dtype], torch.Tensor],
        charge: Callable[..., None], uncharge: Callable[..., None],
        release: Callable[[Payload, torch.Tensor], None],
        waiting: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        self._disk_factory = disk
        self._disk = None
        self._host_empty, self._charge, self._uncharge = host_empty, charge, uncharge
        self._release, self._waiting = release, waiting
        self.wait_seconds = 0.0  # waited for disk reads and writes since the store's reset
        self._reads: dict[str, tuple[Future, torch.Tensor]] = {}
        self._writes: dict[str, tuple[Future, torch.Tensor, Payload]] = {}
        self._wanted: set[str] = set()  # read ahead while written: the write's memory stays
        self._kept: set[str] = set()  # of ``_reads``: a write's memory, nothing read from disk
        self._files: dict[str, int] = {}  # key -> bytes of its file in the spill folder
        self._write_behind = WRITE_BEHIND_BYTES
        self._write_behind_set = False  # set by hand: ``widen_write_behind`` leaves it
        self.writes_skipped = 0  # evictions to disk whose file already held the values

    @property
    def disk(self):  # noqa: ANN201 - a DiskStore (disk.py)
        if self._disk is None:
            if self._disk_factory is None:
                raise RuntimeError("no disk tier was configured for this placement")
            self._disk = self._disk_factory()
        return self._disk

    @property
    def write_behind_bytes(self) -> int:
        """The most spilled bytes still held in memory while written (``reap`` waits past
        it)."""
        return self._write_behind

    @write_behind_bytes.setter
    def write_behind_bytes(self, nbytes: int) -> None:
        self._write_behind, self._write_behind_set = int(nbytes), True

    def widen_write_behind(self, nbytes: int) -> None:
        """Raise the default ``write_behind_bytes`` to ``nbytes`` (a value set by hand
        stays): what a window of deferred chunk steps writes (``deferred_step.py``)."""
        if not self._write_behind_set:
            self._write_behind = max(self._write_behind, int(nbytes))

    @property
    def file_bytes(self) -> int:
        """Bytes of the spill folder's files: the disk tier, copies of payloads read back and
        unchanged, and stale files kept for their key's next write."""
        return sum(self._files.values())

    def modified(self, payload: Payload) -> None:
        """The caller is about to change ``payload``'s values: its file is no copy any more."""
        payload.copy_on_disk = False

    def write_behind(self, payload: Payload, data: torch.Tensor) -> int:
        """Start writing ``data`` (host memory) as ``payload``'s file unless the file already
        holds these values; the bytes written."""
        if payload.copy_on_disk:
            self.writes_skipped += 1
            return 0
        self._writes[payload.key] = (self.disk.write(payload.key, data), data, payload)
        self._files[payload.key] = payload.nbytes
        payload.copy_on_disk = True
        return payload.nbytes

    def prefetch(self, payload: Payload) -> None:
        """Start reading a disk payload back into host memory (no wait)."""
        if payload.tier != Tier.DISK or payload.key in self._reads:
            return
        if payload.key in self._writes:  # still in memory: the fetch will reuse it (and the
            self._wanted.add(payload.key)  # write's completion keeps it, ``_collect``)
            return
        buffer = self._host_empty(payload.numel, payload.dtype)
        self._reads[payload.key] = (self.disk.read(payload.key, buffer), buffer)
        self._charge(Tier.HOST, payload.nbytes, True)  # the read buffer: host working memory

    def read_back(self, payload: Payload, fill: bool = True) -> tuple[torch.Tensor | None, int]:
        """The host memory holding a disk payload's values and the bytes read from disk for
        it; ``fill=False`` (the caller overwrites every value): no read, and None unless memory
        is at hand already (a write-behind's, or a read-ahead's once it completed)."""
        written = self._writes.pop(payload.key, None)
        self._wanted.discard(payload.key)
        if written is not None:  # write-behind not collected yet: its memory still holds it
            self._collect(written)
            return written[1], 0
        if not fill and payload.key not in self._reads:
            return None, 0
        self.prefetch(payload)
        future, buffer = self._reads.pop(payload.key)
        self._wait(future)  # (without fill: the buffer is being written; let it finish)
        self._uncharge(Tier.HOST, payload.nbytes, True)  # charged by the move to its tier
        if payload.key in self._kept:  # a write's memory kept for this fetch: no disk read
            self._kept.discard(payload.key)
            return buffer, 0
        return buffer, payload.nbytes

    def drop_read(self, payload: Payload) -> None:
        """A freed payload's read-ahead is not needed."""
        self._wanted.discard(payload.key)
        self._kept.discard(payload.key)
        read = self._reads.pop(payload.key, None)
        if read is not None:
            self._let_go(read)

    def drop_reads(self, keep: frozenset[str] | set[str] = frozenset()) -> int:
        """Let every read-ahead go (one for a use that did not come) but those of ``keep``
        (keys whose use is still to come); the bytes they held."""
        freed = 0
        self._wanted &= set(keep)
        for key in [k for k in self._reads if k not in keep]:
            self._kept.discard(key)
            freed += self._let_go(self._reads.pop(key))
        return freed

    def _let_go(self, read: tuple[Future, torch.Tensor]) -> int:
        future, buffer = read
        if not future.cancel():  # running: its buffer is being filled, let it finish
            with contextlib.suppress(OSError):
                future.result()
        nbytes = buffer.numel() * buffer.element_size()
        self._uncharge(Tier.HOST, nbytes, True)
        return nbytes

    def _wait(self, future: Future) -> None:
        start = time.perf_counter()
        try:
            if not future.done():
                with self._waiting():
                    future.result()
            future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _collect(self, written: tuple[Future, torch.Tensor, Payload],
                 reuse: bool = False) -> None:
        """Wait for a write-behind; ``reuse``: its memory may serve the next buffer of its size.
        If it failed, the payload is back in host memory (its values were still there) before
        the error is raised: a spill that did not complete loses nothing and is never read as
        complete."""
        future, host, payload = written
        try:
            self._wait(future)
            if reuse and payload.key in self._wanted and payload.tier == Tier.DISK:
                self._wanted.discard(payload.key)  # read ahead: its memory is the read
                self._reads[payload.key] = (future, host)
                self._kept.add(payload.key)
                self._charge(Tier.HOST, payload.nbytes, True)  # as a read-ahead's is
            elif reuse:
                self._release(payload, host)
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
        payload.copy_on_disk = False
        if self.disk.contains(payload.key):  # a failed write in place removed its file
            self._files[payload.key] = self.disk.nbytes(payload.key)
        else:
            self._files.pop(payload.key, None)
        if payload.tier == Tier.DISK:
            payload.handle.data = host
            payload.tier = Tier.HOST
            self._uncharge(Tier.DISK, payload.nbytes)
            self._charge(Tier.HOST, payload.nbytes)

    def reap(self) -> None:
        """Release the memory of completed write-behinds, and wait for the oldest while more
        than ``write_behind_bytes`` are in flight: spilling must not hold what it spilled."""
        pending = 0
        for key, (future, _host, payload) in reversed(list(self._writes.items())):
            pending += payload.nbytes
            if future.done() or pending > self.write_behind_bytes:
                self._collect(self._writes.pop(key), reuse=True)

    def settle_write(self, payload: Payload) -> None:
        written = self._writes.pop(payload.key, None)
        if written is not None:
            self._collect(written)

    def settle(self) -> None:
        """Wait for every write-behind (their memory is released) and surface any error."""
        failed = None
        for key in list(self._writes):
            try:
                self._collect(self._writes.pop(key), reuse=True)
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
        self._kept.clear()
        if self._disk is not None:
            self._disk.close()
