"""The disk tier: tensors as files of a spill folder, read and written on worker threads.

Spilling only relieves memory if the bytes leave RAM, and a file just written or read sits in
the page cache, which is RAM too (a cgroup memory limit counts it). So every write is flushed
(``fdatasync``: dirty pages cannot be dropped) and then the file's cache is dropped
(``POSIX_FADV_DONTNEED``), and so is every read's, a 64 MiB window at a time so a large
tensor never holds more than a window of cache. A write goes to ``<key>.tmp`` and is renamed
over ``<key>`` only once complete, so a failure (a full disk, the file-size limit) leaves the
last complete version readable; a read fills a preallocated tensor of exactly the file's size or
fails, never returning part of one. The files need not survive a crash (spill is worthless
after a restart), so the folder is not synced.

Operations on one key run in the order they were issued (each key has a lane: one of the worker
threads, chosen by the key's hash); different keys run in parallel. File I/O releases the GIL.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

_sync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync
CACHE_WINDOW = 64 * 2**20  # the most page cache one read or write holds at a time
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


def drop_page_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to forget the cached pages of ``fd``'s file (clean pages only; length 0:
    to the end)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _reason(error: OSError) -> str:
    return _REASONS.get(error.errno, error.strerror or str(error))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, shared (any dtype, bfloat16 included: no numpy dtype involved)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _write_through(fd: int, data: memoryview) -> None:
    """Write ``data`` a window at a time, each flushed and dropped from the cache before the
    next, so a large tensor never holds more than a window of page cache."""
    for start in range(0, len(data), CACHE_WINDOW):
        window = data[start:start + CACHE_WINDOW]
        done = 0
        while done < len(window):  # one write() moves at most ~2 GiB on Linux
            done += os.write(fd, window[done:])
        _sync(fd)
        drop_page_cache(fd, start, len(window))


def _read_through(fd: int, data: memoryview) -> int:
    """Fill ``data`` from the file a window at a time, dropping each window's cache; returns
    the bytes read (fewer than asked only if the file ended)."""
    done = 0
    while done < len(data):
        got = os.readv(fd, [data[done:done + CACHE_WINDOW]])
        if got == 0:
            break
        drop_page_cache(fd, done, got)
        done += got
    return done


class DiskStore:
    """Tensors of ``folder`` by key: ``write``/``read`` return futures, run on ``threads``
    worker threads; counters of bytes, seconds and operations are kept (see the module
    docstring for what makes the files trustworthy and the memory really free)."""

    def __init__(self, folder: Path, threads: int = 2) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise DiskSpillError(self.folder, "", "open", "the folder does not exist "
                                 "(create it with SpillDir)", errno.ENOENT)
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"disk-spill-{i}")
                       for i in range(max(1, threads))]
        self._lock = threading.Lock()
        self._latest: dict[str, Future] = {}  # each key's last issued operation
        self._closed = False
        self.bytes_written = self.bytes_read = 0
        self.write_seconds = self.read_seconds = 0.0
        self.writes = self.reads = 0

    # ---- scheduling ----------------------------------------------------------------------
    def _submit(self, key: str, operation, *args) -> Future:
        _check_key(key)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the disk store of {self.folder} is closed")
            lane = self._lanes[zlib.crc32(key.encode()) % len(self._lanes)]
            future = lane.submit(operation, key, *args)
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
        return self._submit(key, self._write, _byte_view(tensor), tensor)

    def _write(self, key: str, data: memoryview, tensor: torch.Tensor) -> None:
        final, partial = self.folder / key, self.folder / f"{key}.tmp"
        start = time.perf_counter()
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_through(fd, data)
            finally:
                os.close(fd)
            os.replace(partial, final)
        except OSError as e:
            partial.unlink(missing_ok=True)
            raise DiskSpillError(self.folder, key, "write", _reason(e), e.errno) from e
        self._count(True, len(data), time.perf_counter() - start)

    def read(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        """Read ``key`` into ``out`` (contiguous, on the host, of exactly the file's byte
        size); the future's value is ``out``."""
        _check_host_contiguous(out, "read")
        return self._submit(key, self._read, _byte_view(out), out)

    def _read(self, key: str, data: memoryview, out: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            fd = os.open(self.folder / key, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise DiskSpillError(self.folder, key, "read", "no such spilled tensor (never "
                                 "written, deleted, or its write failed)", e.errno) from e
        except OSError as e:
            raise DiskSpillError(self.folder, key, "read", _reason(e), e.errno) from e
        try:
            size = os.fstat(fd).st_size
            if size != len(data):
                raise DiskSpillError(self.folder, key, "read", f"the file holds {size} bytes "
                                     f"but the out tensor has {len(data)}", errno.EINVAL)
            got = _read_through(fd, data)
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

    def delete(self, key: str) -> None:
        """Remove ``key``'s file (after its pending operations); absent keys are fine."""
        _check_key(key)
        self._settle(key)
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
        for lane in self._lanes:
            lane.shutdown(wait=True)

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


def measure_disk_bandwidth(folder: Path, nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """(write, read) bytes per second of one sequential file of ``nbytes`` in ``folder``, the
    page cache bypassed: O_DIRECT with an aligned buffer where the filesystem takes it, else
    written with ``fdatasync`` and its cache dropped before reading. The file is removed."""
    block = 8 * 2**20
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(4096) * (block // 4096))  # incompressible-ish, not zeros
    total = max(4096, -(-nbytes // 4096) * 4096)
    path = Path(folder) / f".bandwidth-{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        direct = getattr(os, "O_DIRECT", 0)
        try:
            write_s = _timed_write(path, buffer, total, direct)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            direct = 0  # the filesystem refuses O_DIRECT (or its alignment): the cache way
            write_s = _timed_write(path, buffer, total, direct)
        read_s = _timed_read(path, buffer, direct)
    finally:
        path.unlink(missing_ok=True)
        buffer.close()
    return total / max(write_s, 1e-9), total / max(read_s, 1e-9)


def _timed_write(path: Path, buffer: mmap.mmap, total: int, direct: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    try:
        with memoryview(buffer) as view:  # released before the buffer is closed
            start = time.perf_counter()
            done = 0
            while done < total:
                done += os.write(fd, view[:min(len(view), total - done)])
            _sync(fd)
            seconds = time.perf_counter() - start
        drop_page_cache(fd)
    finally:
        os.close(fd)
    return seconds


def _timed_read(path: Path, buffer: mmap.mmap, direct: int) -> float:
    fd = os.open(path, os.O_RDONLY | direct)
    try:
        drop_page_cache(fd)
        start = time.perf_counter()
        while os.readv(fd, [buffer]):
            pass
        seconds = time.perf_counter() - start
        drop_page_cache(fd)
    finally:
        os.close(fd)
    return seconds
