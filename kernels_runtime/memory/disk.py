"""The disk tier: tensors as files of a spill folder, read and written on worker threads.

Spilling only relieves memory if the bytes leave RAM, so files are moved without the page cache
(``disk_io.py``: ``O_DIRECT``, else flushed and dropped from the cache a window at a time).
Reads and writes run on threads of their own (a read waiting behind writes would stall the
compute that waits for it), each operation after the ones issued on its key before it (per-key
order: a read sees the last write, a delete removes the file a write just made). File I/O and
the copies through a bounce buffer release the GIL.

A key's file is rewritten in place when it exists with the same size: its blocks are reused,
not freed and allocated again (on this project's VM, ext4 mounted with ``discard``, a new file
plus ``rename`` over the old one wrote at 0.7-1.2 GB/s against 1.6 GB/s in place, and each
freed file cost 3-6 ms of discards). In place only an I/O error can fail (the blocks exist);
then the file is removed, so a broken version is never read as complete. A write that needs
new blocks goes to ``<key>.tmp`` and is renamed over ``<key>`` only once complete, so a
failure for want of space (a full disk, the file-size limit) leaves the last complete version
readable; a read fills a preallocated tensor of exactly the file's size or fails, never
returning part of one. The files need not survive a crash (spill is worthless after a restart),
so nothing is synced for durability.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kernels_runtime.memory import disk_io
from kernels_runtime.memory.disk_io import measure_disk_bandwidth  # noqa: F401 - re-exported

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file-size limit (ulimit -f) was reached",
    errno.EACCES: "the folder is not writable (permission denied)",
    errno.EPERM: "the folder is not writable (operation not permitted)",
    errno.EROFS: "the folder is not writable (read-only filesystem)",
}


class DiskSpillError(OSError):
    """A disk-tier operation failed; the message names the folder, the key and the reason."""

    def __init__(self, folder: Path, key: str, action: str, reason: str,
                 code: int | None = None) -> None:
        super().__init__(f"disk spill could not {action} {key!r} in {folder}: {reason}")
        self.errno = code
        self.folder, self.key, self.action, self.reason = folder, key, action, reason

    def __reduce__(self) -> tuple:  # crosses process boundaries (engines) intact
        return type(self), (self.folder, self.key, self.action, self.reason, self.errno)


def _reason(error: OSError) -> str:
    return _REASONS.get(error.errno, error.strerror or str(error))


def _after(previous: Future | None, operation, *args):
    """Run ``operation`` once the key's previous operation has run (its errors stay its own)."""
    if previous is not None:
        previous.exception()
    return operation(*args)


class DiskStore:
    """Tensors of ``folder`` by key: ``write``/``read``/``delete`` return futures, run on
    ``threads`` reader and ``threads`` writer threads; counters of bytes, seconds and
    operations are kept (see the module docstring for what makes the files trustworthy and
    the memory really free). ``direct=None`` probes the folder for direct I/O."""

    def __init__(self, folder: Path, threads: int = 2, direct: bool | None = None) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise DiskSpillError(self.folder, "", "open", "the folder does not exist "
                                 "(create it with SpillDir)", errno.ENOENT)
        self.direct = disk_io.direct_io_works(self.folder) if direct is None else direct
        self._flags = disk_io.DIRECT if self.direct else 0
        n = max(1, threads)
        self._readers = ThreadPoolExecutor(n, thread_name_prefix="disk-spill-read")
        self._writers = ThreadPoolExecutor(n, thread_name_prefix="disk-spill-write")
        self._lock = threading.Lock()
        self._latest: dict[str, Future] = {}  # each key's last issued operation
        self._closed = False
        self.bytes_written = self.bytes_read = 0
        self.write_seconds = self.read_seconds = 0.0
        self.writes = self.reads = 0
        self.in_place = 0  # writes that reused their key's file

    # ---- scheduling ----------------------------------------------------------------------
    def _submit(self, key: str, pool: ThreadPoolExecutor, operation, *args) -> Future:
        _check_key(key)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the disk store of {self.folder} is closed")
            future = pool.submit(_after, self._latest.get(key), operation, key, *args)
            self._latest[key] = future
        future.add_done_callback(lambda done: self._forget(key, done))
        return future

    def _forget(self, key: str, done: Future) -> None:
        with self._lock:
            if self._latest.get(key) is done:
                del self._latest[key]

    def _settle(self, key: str) -> None:
        """Wait until the operations issued on ``key`` have run (their errors stay theirs)."""
        with self._lock:
            pending = self._latest.get(key)
        if pending is not None:
            pending.exception()

    def _count(self, wrote: bool, nbytes: int, seconds: float) -> None:
        with self._lock:
            if wrote:
                self.bytes_written += nbytes
                self.write_seconds += seconds
                self.writes += 1
            else:
                self.bytes_read += nbytes
                self.read_seconds += seconds
                self.reads += 1

    # ---- operations ----------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor) -> Future[None]:
        """Write ``tensor`` (contiguous, on the host) as ``key``, replacing any earlier version
        once complete. The tensor must not be modified until the future is done."""
        _check_host_contiguous(tensor, "write")
        return self._submit(key, self._writers, self._write, tensor)

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        nbytes = tensor.numel() * tensor.element_size()
        if not self._write_in_place(key, tensor, nbytes):
            self._write_new(key, tensor)
        self._count(True, nbytes, time.perf_counter() - start)

    def _put(self, fd: int, tensor: torch.Tensor) -> None:
        if self.direct:
            try:
                disk_io.write_direct(fd, tensor)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            # a block refused directly (a file-size limit inside it): the cache way says why
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~disk_io.DIRECT)
        disk_io.write_cached(fd, tensor)

    def _write_in_place(self, key: str, tensor: torch.Tensor, nbytes: int) -> bool:
        """Overwrite ``key``'s file if it has exactly this size; False if there is none such."""
        final = self.folder / key
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CLOEXEC | self._flags)
        except OSError:
            return False  # no file yet (or not openable): the new-file way says why
        try:
            if os.fstat(fd).st_size != nbytes:
                return False
            self._put(fd, tensor)
        except OSError as e:  # only an I/O error can fail here: no half-written file stays
            final.unlink(missing_ok=True)
            raise DiskSpillError(self.folder, key, "write", _reason(e), e.errno) from e
        finally:
            os.close(fd)
        self.in_place += 1
        return True

    def _write_new(self, key: str, tensor: torch.Tensor) -> None:
        final, partial = self.folder / key, self.folder / f"{key}.tmp"
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                         | self._flags, 0o600)
            try:
                self._put(fd, tensor)
            finally:
                os.close(fd)
            os.replace(partial, final)
        except OSError as e:
            partial.unlink(missing_ok=True)
            raise DiskSpillError(self.folder, key, "write", _reason(e), e.errno) from e

    def read(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        """Read ``key`` into ``out`` (contiguous, on the host, of exactly the file's byte
        size); the future's value is ``out``."""
        _check_host_contiguous(out, "read")
        return self._submit(key, self._readers, self._read, out)

    def _read(self, key: str, out: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        nbytes = out.numel() * out.element_size()
        try:
            fd = os.open(self.folder / key, os.O_RDONLY | os.O_CLOEXEC | self._flags)
        except FileNotFoundError as e:
            raise DiskSpillError(self.folder, key, "read", "no such spilled tensor (never "
                                 "written, deleted, or its write failed)", e.errno) from e
        except OSError as e:
            raise DiskSpillError(self.folder, key, "read", _reason(e), e.errno) from e
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise DiskSpillError(self.folder, key, "read", f"the file holds {size} bytes "
                                     f"but the out tensor has {nbytes}", errno.EINVAL)
            got = (disk_io.read_direct if self.direct else disk_io.read_cached)(fd, out)
            if got != size:
                raise DiskSpillError(self.folder, key, "read", f"the file ended after {got} "
                                     f"of {size} bytes", errno.EIO)
        except DiskSpillError:
            raise
        except OSError as e:
            raise DiskSpillError(self.folder, key, "read", _reason(e), e.errno) from e
        finally:
            os.close(fd)
        self._count(False, size, time.perf_counter() - start)
        return out

    def delete(self, key: str) -> Future[None]:
        """Remove ``key``'s file after its pending operations, on a writer thread (freeing a
        file's blocks can take milliseconds); absent keys are fine."""
        return self._submit(key, self._writers, self._delete)

    def _delete(self, key: str) -> None:
        try:
            (self.folder / key).unlink(missing_ok=True)
        except OSError as e:
            raise DiskSpillError(self.folder, key, "delete", _reason(e), e.errno) from e

    def contains(self, key: str) -> bool:
        """Whether a complete file of ``key`` exists (after its pending operations)."""
        _check_key(key)
        self._settle(key)
        return (self.folder / key).is_file()

    def nbytes(self, key: str) -> int:
        """Bytes of ``key``'s complete file (after its pending operations)."""
        _check_key(key)
        self._settle(key)
        try:
            return (self.folder / key).stat().st_size
        except FileNotFoundError as e:
            raise DiskSpillError(self.folder, key, "find", "no such spilled tensor",
                                 e.errno) from e

    def close(self) -> None:
        """Wait for pending work, then stop the threads. Safe to call again."""
        with self._lock:
            self._closed = True
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(key: str) -> None:
    if not key or "/" in key or key.startswith(".") or key.endswith(".tmp") or "\0" in key:
        raise ValueError(f"spill key {key!r} must be a plain file name (no '/', no leading "
                         "'.', no '.tmp' ending)")


def _check_host_contiguous(tensor: torch.Tensor, action: str) -> None:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"DiskStore can only {action} a contiguous host tensor, got one on "
                         f"{tensor.device} (contiguous: {tensor.is_contiguous()})")
